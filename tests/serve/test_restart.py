"""A restarted server reuses what the previous process stored."""

from __future__ import annotations

import openai

from impress_cache.serve.launch import http_json

from .conftest import start_server

DOC = " ".join(f"Paragraph {i} of a document that the next process must not recompute." for i in range(10))


def test_a_restarted_server_reuses_the_prompts_stored_before(model_dir, tmp_path):
    messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "Summarise it."}]
    answers = []
    for run in range(2):
        with start_server(model_dir, tmp_path / "stores", tmp_path / f"server{run}.log") as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            mid = http_json(server.url + "/v1/models")[1]["data"][0]["id"]
            resp = client.chat.completions.create(model=mid, messages=messages, max_tokens=12, temperature=0)
            answers.append(resp)
    first, after = answers
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert after.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert after.choices[0].message.content == first.choices[0].message.content
