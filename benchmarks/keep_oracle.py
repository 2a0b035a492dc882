"""A reference for ``decode="keep"``: attention to the ``ratio`` of the prefix with the
most attention, chosen with the exact keys, for every token and KV head.

The answers benchmark (``benchmarks/answers.py``) measures what the library's keep mode
gives: every layer holds ``k = ratio x P`` prefix rows, chosen from int4 probe copies of
the keys and read from disk (with ``keep_reselect=1`` chosen again at every token, per
KV head). This script asks how much better that choice could get with perfect scores
(a reference policy, not a proven bound on agreement): the model runs in
memory with an attention function that, for every query row after the prefix (the
question and every generated token) and every KV head, keeps the ``k`` prefix rows with
the most attention (softmax over the prefix, summed over the head's query group, from
the exact keys), and masks the rest. Nothing is read from disk; it is slow (attention in
Python) and only a reference: a cache cannot know the exact scores without the keys.

``--modes`` also takes ``dyn-kv-sum``: at the same memory, ``k - P/16`` rows plus, per
16-row block, one summary of the rows not kept (their mean key, with the log of their
count added to its logit, and their mean value), a way to give the dropped rows some of
their attention back.

Same texts, questions, chat template and greedy 32 tokens as ``answers.py`` (its
``--split``); the metric is same-position agreement with full attention.

    python benchmarks/keep_oracle.py --lengths 2048 --questions 10 --out results/keep-oracle.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
import answers as A  # noqa: E402  (the texts and questions)

from impress_cache.tools import load_smollm2  # noqa: E402

BLOCK = 16
NEW_TOKENS = 32
#: what the attention function restricts (prefix length 0: nothing, plain attention)
STATE: dict[str, Any] = {"prefix": 0, "ratio": 0.25, "mode": "dyn-kv"}


def _plain(s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return s.softmax(-1) @ v


def oracle_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **_: Any) -> tuple[torch.Tensor, None]:
    """Eager attention; query rows after the prefix see only their chosen prefix rows."""
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    sc = scaling if scaling is not None else d ** -0.5
    keys, values = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    lk = keys.shape[-2]
    s = (query @ keys.transpose(-1, -2)) * sc
    if attention_mask is not None:
        m = attention_mask[:, :, :, :lk]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    elif n > 1:
        s = s.masked_fill(torch.arange(lk).view(1, -1) > torch.arange(lk - n, lk).view(-1, 1), float("-inf"))
    p, mode = STATE["prefix"], STATE["mode"]
    if not p or lk <= p:
        return _plain(s, values).transpose(1, 2).contiguous(), None
    first = max(0, p - (lk - n))  # query rows before this one are prefix rows: not restricted
    head = _plain(s[:, :, :first], values)
    s, q, n = s[:, :, first:], query[:, :, first:], n - first
    pre, rest = s[..., :p], s[..., p:]
    nb = p // BLOCK
    if mode == "dyn-kv-sum" and p % BLOCK:
        raise ValueError(f"dyn-kv-sum needs a prefix length that is a multiple of {BLOCK}, got {p}")
    k = int(round(STATE["ratio"] * p)) - (nb if mode == "dyn-kv-sum" else 0)
    per_kv = pre.softmax(-1).view(b, hkv, g, n, p).sum(2)
    keep = torch.zeros_like(per_kv, dtype=torch.bool).scatter_(-1, per_kv.topk(k, -1).indices, True)
    parts = [pre.masked_fill(~keep.repeat_interleave(g, 1), float("-inf"))]
    if mode == "dyn-kv-sum":
        dropped = (~keep).float().view(b, hkv, n, nb, BLOCK)
        count = dropped.sum(-1)
        kb = key[:, :, :p].reshape(b, hkv, nb, BLOCK, d)
        vb = value[:, :, :p].reshape(b, hkv, nb, BLOCK, d)
        mean_k = torch.einsum("bhnjc,bhjcd->bhnjd", dropped, kb) / count.clamp(min=1)[..., None]
        mean_v = torch.einsum("bhnjc,bhjcd->bhnjd", dropped, vb) / count.clamp(min=1)[..., None]
        ls = torch.einsum("bhgnd,bhnjd->bhgnj", q.reshape(b, hkv, g, n, d), mean_k) * sc
        bias = torch.where(count > 0, count.clamp(min=1).log(), torch.full_like(count, float("-inf")))
        parts.append((ls + bias.unsqueeze(2)).reshape(b, hq, n, nb))
    parts.append(rest)
    w = torch.cat(parts, -1).softmax(-1)
    out = w[..., :p] @ values[:, :, :p] + w[..., w.shape[-1] - rest.shape[-1]:] @ values[:, :, p:]
    if mode == "dyn-kv-sum":
        ws = w[..., p : p + nb].reshape(b, hkv, g, n, nb)
        out = out + torch.einsum("bhgnj,bhnjd->bhgnd", ws, mean_v).reshape(b, hq, n, d)
    return torch.cat([head, out], 2).transpose(1, 2).contiguous(), None


def greedy(model: Any, ids: torch.Tensor, eos: int | None) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=eos)
    return out[0, ids.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--questions", type=int, default=10, help="per text (answers.py asks 10)")
    ap.add_argument("--only", type=int, nargs="*", help="question indices to run (default: all)")
    ap.add_argument("--modes", nargs="+", default=["dyn-kv"], choices=["dyn-kv", "dyn-kv-sum"])
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--split", default="heldout", choices=["heldout", "tune"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/keep-oracle.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    AttentionInterface.register("impress_oracle", oracle_attention)
    AttentionMaskInterface.register("impress_oracle", sdpa_mask)
    model, tok = load_smollm2(attn="impress_oracle")
    eos = tok.eos_token_id
    rows = []
    for length in args.lengths:
        for kind in ("prose", "code"):
            held = A.heldout_variant(kind, length)
            text = A.build_text(tok, kind, length, held if args.split == "heldout" else 1 - held)
            for qi in range(args.questions):
                if args.only and qi not in args.only:
                    continue
                ids = torch.tensor([text["prefix"] + text["suffixes"][qi]])
                STATE["prefix"] = 0
                ref = greedy(model, ids, eos)
                for mode in args.modes:
                    STATE.update(prefix=length, ratio=args.ratio, mode=mode)
                    got = greedy(model, ids, eos)
                    pa, pb = ref + [-1] * (NEW_TOKENS - len(ref)), got + [-1] * (NEW_TOKENS - len(got))
                    rows.append({"mode": mode, "text": text["id"], "kind": kind, "length": length, "question": qi,
                                 "first_token": float(bool(ref) and bool(got) and ref[0] == got[0]),
                                 "same_position": sum(x == y for x, y in zip(pa, pb)) / NEW_TOKENS})
                    print(f"{text['id']:>16} q{qi} {mode:>10}: same-position {rows[-1]['same_position']:.3f}",
                          file=sys.stderr, flush=True)
    summary = {}
    for r in rows:
        summary.setdefault(f"{r['mode']}@{r['length']}", []).append(r)
    result = {
        "meta": {"command": "python benchmarks/keep_oracle.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "model": "SmolLM2-135M-Instruct (float32), chat template, greedy 32 tokens",
                 "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
                 "ratio": args.ratio, "split": args.split, "seconds": round(time.perf_counter() - t0, 1)},
        "summary": {key: {"n": len(rs), "first_token": sum(r["first_token"] for r in rs) / len(rs),
                          "same_position": sum(r["same_position"] for r in rs) / len(rs)}
                    for key, rs in summary.items()},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
