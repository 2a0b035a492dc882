"""Regression check: which prefix rows sparse loading selects, and what it reads.

    python benchmarks/selections.py --out results/selections.json
    python benchmarks/selections.py --compare OLD.json NEW.json

For a few real prefixes (SmolLM2-135M, ``pydoc_data`` prose and standard-library code,
1k-4k tokens, two questions each) and every selection mode at important_ratio 0.1 and
0.25 (decode "full" and "keep"), one prefill plus four forced decode steps run through
an `ImpressCache`. The output records, per run, a digest of ``cache.selections`` (every
layer's chosen positions), the first-token argmax, a digest of the greedy
next tokens, and the byte counters of ``cache.stats``. Two runs of different code
versions that select the same rows give identical digests; ``--compare`` lists every
field that differs. Used to show that a refactoring changed no selection.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import QUESTION, EXTRA_QUESTIONS, corpus_tokens  # noqa: E402

import impress_cache  # noqa: E402
from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402

try:  # the demo helpers moved in the redesign; both layouts are supported here
    from impress_cache.tools import load_smollm2
except ImportError:  # pragma: no cover - older layout
    from impress_cache.models import load_smollm2  # type: ignore[no-redef]

#: no background reordering: a rewrite between runs would change the blocks (and with
#: them block selections) depending on timing
FIXED = {"reorg_idle_ms": None}

CONFIGS = [
    {"important_ratio": r, "selection": s, "decode": d}
    for r in (0.1, 0.25)
    for s in ("block", "token")
    for d in ("full", "keep")
] + [{"important_ratio": 0.25, "selection": b, "decode": "full"} for b in ("random", "recent", "h2o")]
STAT_FIELDS = (
    "matched_tokens", "computed_tokens", "loaded_tokens", "bytes_read_probe", "bytes_read_rows",
    "bytes_read_decode", "fallback_layers",
)


def _digest(selections: dict[int, dict[int, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for layer in sorted(selections):
        for row in sorted(selections[layer]):
            h.update(f"{layer}/{row}:".encode())
            h.update(selections[layer][row].to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def one_run(model: Any, store: ImpressStore, ids: torch.Tensor, steps: int = 4) -> dict[str, Any]:
    cache = ImpressCache(store, ids, store_prompt=False)
    out = model(ids[:, cache.reused_tokens :], past_key_values=cache, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    s = cache.stats
    row = {"selections": _digest(cache.selections), "first_token": tokens[0], "tokens": tokens}
    for f in STAT_FIELDS:
        v = getattr(s, f, None)
        row[f] = len(v) if isinstance(v, list) else v
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("prose", "code"):
            for length in args.lengths:
                prefix = corpus_tokens(tok, kind, length)
                questions = [QUESTION[kind], EXTRA_QUESTIONS[kind][0]]
                path = Path(tmp) / f"{kind}-{length}"
                first = torch.tensor([prefix + tok(questions[0], add_special_tokens=False)["input_ids"]])
                with ImpressStore(path, model, ImpressConfig(important_ratio=1.0, **FIXED)) as store, torch.no_grad():
                    c = ImpressCache(store, first[:, : len(prefix) + 1])
                    model(first[:, : len(prefix) + 1], past_key_values=c, use_cache=True)
                for qi, q in enumerate(questions):
                    ids = torch.tensor([prefix + tok(q, add_special_tokens=False)["input_ids"]])
                    for cfg in CONFIGS:
                        with ImpressStore(path, model, ImpressConfig(**cfg, **FIXED)) as store:
                            res = one_run(model, store, ids)
                        rows.append({"corpus": kind, "prefix_tokens": length, "question": qi, **cfg, **res})
                        print(json.dumps(rows[-1]), flush=True)
    return {"impress_cache": str(Path(impress_cache.__file__).parent), "rows": rows}


def compare(a_path: str, b_path: str) -> int:
    a = json.load(open(a_path))["rows"]
    b = json.load(open(b_path))["rows"]
    if len(a) != len(b):
        print(f"different numbers of runs: {len(a)} and {len(b)}")
        return 1
    diffs = 0
    for ra, rb in zip(a, b):
        for key in ra.keys() & rb.keys():
            if ra[key] != rb.get(key):
                diffs += 1
                where = {k: ra[k] for k in ("corpus", "prefix_tokens", "question", "important_ratio", "selection", "decode")}
                print(f"{where}: {key} {ra[key]!r} -> {rb.get(key)!r}")
    print(f"{len(a)} runs compared, {diffs} differing fields")
    return 1 if diffs else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/selections.json")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
