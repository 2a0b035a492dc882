"""The real SmolLM2-135M-Instruct (GGUF) behind ``impress-cache serve``: a chat turn, and
a second turn that reuses the first one's prompt."""

from __future__ import annotations

import openai
import pytest

from impress_cache.serve.launch import http_json
from impress_cache.tools.models import SMOLLM2_FILE, smollm2_path

from .conftest import start_server

pytestmark = pytest.mark.slow


def test_smollm2_answers_and_the_second_turn_reuses_the_first(tmp_path):
    with start_server(smollm2_path() / SMOLLM2_FILE, tmp_path / "stores", tmp_path / "server.log") as server:
        mid = http_json(server.url + "/v1/models")[1]["data"][0]["id"]
        assert mid == SMOLLM2_FILE.removesuffix(".gguf")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [
            {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        first = client.chat.completions.create(model=mid, messages=messages, max_tokens=24, temperature=0)
        answer = first.choices[0].message.content
        assert "Paris" in answer
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
        second = client.chat.completions.create(model=mid, messages=messages, max_tokens=24, temperature=0)
        assert "Rome" in second.choices[0].message.content
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
