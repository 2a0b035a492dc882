"""``impress-cache serve`` through real HTTP with the official ``openai`` client: a tiny
random Llama with SmolLM2's tokenizer and chat template, greedy decoding, exact reuse."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from impress_cache.serve.launch import http_json

from .conftest import CONTEXT

MODEL = "tiny-chat"  # overwritten per server: the directory's name
DOC = " ".join(f"Section {i}: the store keeps keys and values of long prompts on disk." for i in range(12))


def model_id(server) -> str:
    return http_json(server.url + "/v1/models")[1]["data"][0]["id"]


def chat(client, server, messages, salt=None, max_tokens=12, **kw):
    extra = {"cache_salt": salt} if salt is not None else None
    return client.chat.completions.create(
        model=model_id(server), messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra, **kw
    )


def cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def conversation(question: str = "What does the store keep?") -> list[dict]:
    return [{"role": "system", "content": DOC}, {"role": "user", "content": question}]


def test_models_and_health(server, model_dir):
    status, body = http_json(server.url + "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [model_dir.name]
    status, body = http_json(server.url + "/health")
    assert status == 200 and body["status"] == "ok"


def test_a_repeated_chat_and_the_next_turn_reuse_what_was_stored(client, server, salt):
    first = chat(client, server, conversation(), salt)
    assert cached(first) == 0 and first.usage.prompt_tokens > 100
    again = chat(client, server, conversation(), salt)
    # everything but the last token (the model must compute at least one)
    assert cached(again) == first.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    # the next turn, sent right after the answer: it matches at least the first prompt
    turn2 = conversation() + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And after a restart?"},
    ]
    second = chat(client, server, turn2, salt)
    # it matches through the answer (stored with the prompt; the server puts the answer's
    # generated ids back in place of its re-tokenized text): all but the answer's last token
    answer = first.usage.completion_tokens
    assert cached(second) >= first.usage.prompt_tokens + answer - 1 - (1 if first.choices[0].finish_reason == "stop" else 0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_streaming_gives_the_same_text_as_one_response(client, server, salt):
    whole = chat(client, server, conversation("Is it fast?"), salt, max_tokens=16)
    pieces, usage, finish = [], None, None
    stream = chat(client, server, conversation("Is it fast?"), salt, max_tokens=16, stream=True,
                  stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert sum(1 for p in pieces if p) > 1  # text came in pieces, token by token, not as one block at the end
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1


def test_text_completions_plain_and_streamed(client, server, salt):
    prompt = DOC + " The store"
    kw = dict(model=model_id(server), prompt=prompt, max_tokens=10, temperature=0, extra_body={"cache_salt": salt})
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.choices[0].text == second.choices[0].text
    assert cached(first) == 0 and cached(second) == first.usage.prompt_tokens - 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == first.choices[0].text
    # token ids as the prompt
    ids = client.completions.create(**{**kw, "prompt": [1, 2, 3, 400, 500]})
    assert ids.usage.prompt_tokens == 5


def test_two_tenants_never_see_each_others_prefixes(client, server):
    a, b = "tenant-a-" + server.url, "tenant-b-" + server.url
    stored = chat(client, server, conversation("Tenants?"), a)
    assert cached(stored) == 0
    assert cached(chat(client, server, conversation("Tenants?"), b)) == 0  # b stored its own now
    assert cached(chat(client, server, conversation("Tenants?"), None)) == 0  # no salt: the default tenant
    assert cached(chat(client, server, conversation("Tenants?"), a)) == stored.usage.prompt_tokens - 1
    assert cached(chat(client, server, conversation("Tenants?"), b)) == stored.usage.prompt_tokens - 1
    # one directory per tenant; the salts appear neither on disk nor in the metrics
    names = {p.name for p in (server.root / "tenants").iterdir()}
    assert len(names) >= 2 and a not in names and b not in names
    text = http_json(server.url + "/metrics")[1]
    assert a not in text and b not in text


def test_eight_concurrent_clients_get_the_answers_of_sequential_requests(client, server, salt):
    questions = [conversation(f"Question {i}: what is in section {i}?") for i in range(8)]
    sequential = [chat(client, server, q, salt + "-seq", max_tokens=16).choices[0].message.content for q in questions]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda q: chat(client, server, q, salt + "-par", max_tokens=16), questions))
    assert [r.choices[0].message.content for r in results] == sequential
    # they shared the stored document: all but the first to run matched part of it
    assert sum(cached(r) > 0 for r in results) >= 7


def test_bad_requests_get_4xx_in_openais_shape_and_the_server_keeps_serving(client, server):
    mid, url = model_id(server), server.url + "/v1/chat/completions"
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=conversation(), max_tokens=4)
    assert exc.value.body["code"] == "model_not_found"
    long = [{"role": "user", "content": "word " * (CONTEXT + 50)}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=mid, messages=long, max_tokens=4)
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=mid, messages=conversation(), max_tokens=CONTEXT)
    bad_bodies = [
        b"{not json", b"[1, 2]", b"",
        {"model": mid}, {"model": mid, "messages": []}, {"model": mid, "messages": "hello"},
        {"model": mid, "messages": conversation(), "max_tokens": "ten"},
        {"model": mid, "messages": conversation(), "temperature": "hot"},
        {"model": mid, "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": mid, "messages": conversation(), "n": 2},
        {"model": mid, "messages": conversation(), "cache_salt": 7},
        {"model": 3, "messages": conversation()},
    ]
    for body in bad_bodies:
        status, answer = http_json(url, body)
        assert status == 400, (body, status, answer)
        assert set(answer["error"]) >= {"message", "type", "param", "code"}
    status, answer = http_json(server.url + "/v1/completions", {"model": mid, "prompt": [10**9]})
    assert status == 400
    status, answer = http_json(server.url + "/v1/completions", {"model": mid, "prompt": ["a", "b"]})
    assert status == 400
    assert http_json(server.url + "/health")[0] == 200
    assert chat(client, server, conversation(), max_tokens=2).choices[0].message.content is not None


def test_metrics_count_requests_tokens_and_the_store(client, server, salt):
    chat(client, server, conversation("Metrics?"), salt)
    chat(client, server, conversation("Metrics?"), salt)
    status, text = http_json(server.url + "/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['impress_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2
    assert values["impress_matched_tokens_total"] > 0 and values["impress_computed_tokens_total"] > 0
    assert values["impress_bytes_read_disk_total"] > 0
    assert values["impress_ttft_seconds_count"] >= 2
    assert values["impress_store_disk_bytes"] > 0 and values["impress_store_nodes"] > 0
    for name in ("impress_store_prefixes_evicted_total", "impress_store_quarantined_files_total",
                 "impress_guard_firings_total"):
        assert name in values


def test_prune_while_the_server_uses_the_store(client, server, salt, capsys):
    from impress_cache.cli import main
    from impress_cache.serve.tenancy import tenant_dir

    first = chat(client, server, conversation("Prune?"), salt)
    assert cached(chat(client, server, conversation("Prune?"), salt)) > 0
    capsys.readouterr()
    assert main(["prune", str(tenant_dir(server.root, salt)), "--to", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["removed_prefixes"] >= 1
    after = chat(client, server, conversation("Prune?"), salt)  # the server saw the removal: recomputed, same answer
    assert cached(after) == 0 and after.choices[0].message.content == first.choices[0].message.content
    assert cached(chat(client, server, conversation("Prune?"), salt)) > 0  # and stores it again


def test_a_client_that_leaves_mid_stream_does_not_disturb_the_server(client, server, salt):
    stream = chat(client, server, conversation("Leave?"), salt, max_tokens=200, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # the connection goes away after the first piece of text
    after = chat(client, server, conversation("Leave?"), salt, max_tokens=8)
    fresh = chat(client, server, conversation("Leave?"), salt + "-fresh", max_tokens=8)
    assert after.choices[0].message.content == fresh.choices[0].message.content
    assert http_json(server.url + "/health")[0] == 200


def test_stats_of_the_servers_root_names_every_tenant_store_and_the_hit_rates(client, server, salt, capsys):
    from impress_cache.cli import main

    chat(client, server, conversation("Stats?"), salt)
    chat(client, server, conversation("Stats?"), salt)
    capsys.readouterr()
    assert main(["stats", str(server.root)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "default" in out["stores"] and any(name.startswith("tenants/") for name in out["stores"])
    assert all(s["model"]["model_type"] == "llama" for s in out["stores"].values())
    serving = out["serving"]
    assert serving["requests"] >= 2 and 0 < serving["token_hit_rate"] < 1
    assert salt not in json.dumps(out)
