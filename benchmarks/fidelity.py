"""Fidelity benchmark: sparse prefix loading against dense reuse, on SmolLM2-135M.

    python benchmarks/fidelity.py --out results/fidelity.json            # full run (~15-25 min)
    python benchmarks/fidelity.py --quick --out results/fidelity-quick.json

For every prefix (1k, 2k, 4k and 7.5k tokens of ``pydoc_data.topics`` prose and of
standard-library source code, each followed by a question or instruction) the prefix is
stored once, then every configuration answers from the store:

* IMPRESS at important_ratio 0.1 / 0.25 / 0.5, selection "token" and "block", decode
  "full" and "keep";
* same-budget baselines (decode "full"): random rows, sinks + most recent rows
  (StreamingLLM-like) and H2O-like (all keys read, top-k by accumulated attention).

Each configuration is compared with dense reuse (important_ratio 1.0, which equals no
cache): first-token agreement, teacher-forced top-1 agreement over 32 tokens (the dense
tokens are fed back, so one early difference does not spoil the rest), mean KL divergence
of the next-token distributions, and bytes read from disk. Chunk files are dropped from
the page cache before every configuration (``posix_fadvise(DONTNEED)`` after ``fsync``:
"guest-cold"; the hypervisor may still cache them).

A passkey test plants a random 5-digit number at 10%, 50% and 90% depth of a 4k-token
prefix and asks for it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG
from impress_cache.tools import drop_page_cache, load_smollm2

QUESTION = {
    "prose": "\n\nQuestion: In two sentences, what is the text above about?\nAnswer:",
    "code": "\n\n# Instruction: explain in two sentences what the code above does.\n# Explanation:",
}
#: more questions per prefix, for the first-token sweep (prefill only; the first question
#: above is asked too)
EXTRA_QUESTIONS = {
    "prose": [
        "\n\nQuestion: Which Python feature does the text above describe first?\nAnswer:",
        "\n\nSummarize the text above in one sentence.\nSummary:",
        "\n\nQuestion: Name one keyword that appears in the text above.\nAnswer:",
        "\n\nQ: Is the text above from a tutorial or from a reference manual?\nA:",
    ],
    "code": [
        "\n\n# Question: which classes are defined above?\n# Answer:",
        "\n\n# Summary of the code above, in one sentence:\n#",
        "\n\n# Instruction: name two functions defined above.\n# Answer:",
        "\n\n# Q: what would be a good name for the file above?\n# A:",
    ],
}
#: configurations of the first-token sweep (important_ratio 0.25, decode "full")
SWEEP = (("impress", "block"), ("impress", "token"))
STDLIB_SOURCES = ("argparse.py", "inspect.py", "textwrap.py", "dataclasses.py", "tarfile.py", "typing.py")


# -- inputs -----------------------------------------------------------------------------
def corpus_tokens(tok: Any, kind: str, n: int, offset: int = 0) -> list[int]:
    if kind == "prose":
        from pydoc_data.topics import topics

        names = sorted(topics)
        text = "\n\n".join(topics[name] for name in names[offset:] + names[:offset])
    else:
        import sysconfig

        lib = Path(sysconfig.get_paths()["stdlib"])
        text = "\n\n".join((lib / name).read_text(errors="replace") for name in STDLIB_SOURCES)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise RuntimeError(f"{kind} corpus has only {len(ids)} tokens, {n} wanted")
    return ids[:n]


# -- one configuration -----------------------------------------------------------------
@torch.no_grad()
def forced_run(model: Any, store: ImpressStore, ids: torch.Tensor, forced: list[int]) -> dict[str, Any]:
    """Prefill through an ImpressCache, then feed ``forced`` tokens one at a time.

    Returns the next-token log-probabilities after the prompt and after each forced token.
    """
    t0 = time.perf_counter()
    cache = ImpressCache(store, ids, store_prompt=False)
    out = model(ids[:, cache.reused_tokens :], **{CACHE_KWARG: cache}, use_cache=True)
    logp = [F.log_softmax(out.logits[0, -1].float(), -1)]
    ttft = time.perf_counter() - t0
    for t in forced[:-1]:
        out = model(torch.tensor([[t]]), **{CACHE_KWARG: cache}, use_cache=True)
        logp.append(F.log_softmax(out.logits[0, -1].float(), -1))
    s = cache.stats
    return {
        "logp": torch.stack(logp),
        "ttft_s": ttft,
        "reused": cache.reused_tokens,
        "loaded_tokens": s.loaded_tokens,
        "bytes_read_probe": s.bytes_read_probe,
        "bytes_read_rows": s.bytes_read_rows,
        "bytes_read_decode": s.bytes_read_decode,
        "bytes_read_disk": s.bytes_read_disk,
        "invalid_io_ratio": s.invalid_io_ratio,
        "fallback_layers": len(s.fallback_layers),
        "rows_selected": s.rows_selected,
        "blocks_touched": s.blocks_touched,
        "blocks_per_selected_row": s.blocks_per_selected_row,
        "mean_similarity": sum(s.layer_similarity) / max(1, len(s.layer_similarity)),
    }


def model_kv_bytes_per_token(model: Any) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * itemsize


def compare(ref: torch.Tensor, got: torch.Tensor, forced: list[int]) -> dict[str, float]:
    top1 = got.argmax(-1)
    target = torch.tensor(forced)
    kl = (ref.exp() * (ref - got)).sum(-1)  # KL(dense || config) per step
    return {
        "first_token": float(top1[0] == target[0]),
        "top1_agreement": float((top1 == target).float().mean()),
        "mean_kl": float(kl.mean()),
    }


def first_step(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """First-token agreement and KL(dense || config) of one next-token log-distribution."""
    return float(got.argmax() == ref.argmax()), float((ref.exp() * (ref - got)).sum())


def configurations(ratios: list[float], quick: bool) -> list[dict[str, Any]]:
    out = []
    for r in ratios:
        for sel in ("block",) if quick else ("block", "token"):
            for dec in ("full", "keep"):
                out.append({"method": "impress", "important_ratio": r, "selection": sel, "decode": dec})
        for base in ("random", "recent", "h2o"):
            out.append({"method": base, "important_ratio": r, "selection": base, "decode": "full"})
    return out


# -- the runs ---------------------------------------------------------------------------
def run_prefix(
    model: Any, tok: Any, kind: str, length: int, ratios: list[float], quick: bool, base_cfg: dict[str, Any], work: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    prefix = corpus_tokens(tok, kind, length)
    question = tok(QUESTION[kind], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prefix + question])
    store_dir = work / f"{kind}-{length}"
    with ImpressStore(store_dir, model, ImpressConfig(important_ratio=1.0, **base_cfg)) as store:
        with torch.no_grad():
            first = torch.tensor([prefix + question[:1]])
            model(first, **{CACHE_KWARG: ImpressCache(store, first)}, use_cache=True)  # compute and store the prefix once
        store.flush()
        drop_page_cache(store_dir)
        # dense reference: greedy tokens, then the same forced run
        greedy: list[int] = []
        with torch.no_grad():
            gen = model.generate(ids, **{CACHE_KWARG: ImpressCache(store, ids, store_prompt=False)}, max_new_tokens=32, do_sample=False)
        greedy = gen[0, ids.shape[1] :].tolist()
        drop_page_cache(store_dir)
        dense = forced_run(model, store, ids, greedy)
    rows = [{"corpus": kind, "prefix_tokens": length, "method": "dense", "important_ratio": 1.0, "selection": "-", "decode": "full",
             **{k: v for k, v in dense.items() if k != "logp"}, "first_token": 1.0, "top1_agreement": 1.0, "mean_kl": 0.0}]
    # what a dense reuse reads: every K/V row of the reused prefix
    full_bytes = dense["reused"] * model_kv_bytes_per_token(model)
    for cfg in tqdm(configurations(ratios, quick), desc=f"{kind} {length}", leave=False):
        conf = ImpressConfig(
            important_ratio=cfg["important_ratio"], selection=cfg["selection"], decode=cfg["decode"], **base_cfg
        )
        with ImpressStore(store_dir, model, conf) as store:
            drop_page_cache(store_dir)
            res = forced_run(model, store, ids, greedy)
        row = {"corpus": kind, "prefix_tokens": length, **cfg, **{k: v for k, v in res.items() if k != "logp"}}
        row.update(compare(dense["logp"], res["logp"], greedy))
        prefill_bytes = res["bytes_read_probe"] + res["bytes_read_rows"]
        row["prefill_bytes_vs_full"] = prefill_bytes / full_bytes
        rows.append(row)
    return rows, first_token_sweep(model, tok, kind, length, prefix, store_dir, base_cfg)


def first_token_sweep(
    model: Any, tok: Any, kind: str, length: int, prefix: list[int], store_dir: Path, base_cfg: dict[str, Any]
) -> list[dict[str, Any]]:
    """First token and first-step KL of `SWEEP` against dense, for `EXTRA_QUESTIONS`."""
    out = []
    for qi, text in enumerate(EXTRA_QUESTIONS[kind]):
        ids = torch.tensor([prefix + tok(text, add_special_tokens=False)["input_ids"]])
        with ImpressStore(store_dir, model, ImpressConfig(important_ratio=1.0, **base_cfg)) as store:
            drop_page_cache(store_dir)
            ref = forced_run(model, store, ids, [0])["logp"][0]
        for method, sel in SWEEP:
            conf = ImpressConfig(important_ratio=0.25, selection=sel, decode="full", **base_cfg)
            with ImpressStore(store_dir, model, conf) as store:
                drop_page_cache(store_dir)
                res = forced_run(model, store, ids, [0])
            agree, kl = first_step(ref, res["logp"][0])
            top2 = ref.topk(2).values
            out.append({
                "corpus": kind, "prefix_tokens": length, "question": qi + 1, "method": method, "selection": sel,
                "first_token": agree,
                "kl_first": kl,
                "dense_margin": float(top2[0] - top2[1]),
                "prefill_bytes": res["bytes_read_probe"] + res["bytes_read_rows"],
            })
    return out


def passkey(model: Any, tok: Any, depths: list[float], seeds: int, work: Path, base_cfg: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    filler = corpus_tokens(tok, "prose", 3900, offset=20)
    configs = [("dense", 1.0, "block")] + [(m, 0.25, s) for m, s in (("impress", "block"), ("impress-token", "token"), ("random", "random"), ("recent", "recent"), ("h2o", "h2o"))]
    for depth in depths:
        for seed in range(seeds):
            key = random.Random(f"{depth}-{seed}").randint(10000, 99999)
            needle = tok(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)["input_ids"]
            at = int(len(filler) * depth)
            prefix = filler[:at] + needle + filler[at:]
            question = tok("\n\nWhat is the pass key? The pass key is", add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prefix + question])
            store_dir = work / f"passkey-{depth}-{seed}"
            with ImpressStore(store_dir, model, ImpressConfig(**base_cfg)) as store, torch.no_grad():
                first = torch.tensor([prefix + question[:1]])
                model(first, **{CACHE_KWARG: ImpressCache(store, first)}, use_cache=True)
            for name, ratio, sel in configs:
                conf = ImpressConfig(important_ratio=ratio, selection=sel, decode="full", **base_cfg)
                with ImpressStore(store_dir, model, conf) as store, torch.no_grad():
                    out = model.generate(ids, **{CACHE_KWARG: ImpressCache(store, ids, store_prompt=False)}, max_new_tokens=8, do_sample=False)
                answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
                rows.append({"depth": depth, "seed": seed, "method": name, "important_ratio": ratio, "found": str(key) in answer, "answer": answer.strip()})
    return rows


def summarize(rows: list[dict[str, Any]], pk: list[dict[str, Any]], sweep: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        key = f"{r['method']}|{r['selection']}|{r['decode']}|{r['important_ratio']}"
        groups.setdefault(key, []).append(r)
    table = {}
    for key, rs in groups.items():
        table[key] = {
            "top1_agreement": mean([r["top1_agreement"] for r in rs]),
            "first_token": mean([r["first_token"] for r in rs]),
            "mean_kl": mean([r["mean_kl"] for r in rs]),
            "prefill_bytes_vs_full": mean([r.get("prefill_bytes_vs_full", 1.0) for r in rs]),
            "invalid_io_ratio": mean([r["invalid_io_ratio"] for r in rs]),
            "fallback_layers": mean([r["fallback_layers"] for r in rs]),
            "ttft_s": mean([r["ttft_s"] for r in rs]),
            "n": len(rs),
        }
    pk_acc: dict[str, float] = {}
    for name in sorted({r["method"] for r in pk}):
        hits = [r["found"] for r in pk if r["method"] == name]
        pk_acc[name] = sum(hits) / len(hits)
    # first token over every question: the main one (rows) and the extra ones (sweep)
    pooled: dict[str, dict[str, Any]] = {}
    for method, sel in SWEEP:
        main = [r for r in rows if r["method"] == method and r["selection"] == sel and r["decode"] == "full" and r["important_ratio"] == 0.25]
        extra = [r for r in sweep if r["method"] == method and r["selection"] == sel]
        hits = [r["first_token"] for r in main + extra]
        if hits:
            pooled[sel] = {
                "first_token": mean(hits), "n": len(hits), "misses": len(hits) - int(sum(hits)),
                "mean_kl_first_extra": mean([r["kl_first"] for r in extra]),
            }
    goals = {}
    for sel in ("block", "token"):
        g = table.get(f"impress|{sel}|full|0.25")
        if g is None:
            continue
        goals[sel] = {
            "top1_agreement>=0.95": (g["top1_agreement"], g["top1_agreement"] >= 0.95),
            "first_token>=0.98": (g["first_token"], g["first_token"] >= 0.98),
            "first_token_all_questions>=0.98": (
                pooled.get(sel, {}).get("first_token"), pooled.get(sel, {}).get("first_token", 0.0) >= 0.98
            ),
            "prefill_bytes<=0.40": (g["prefill_bytes_vs_full"], g["prefill_bytes_vs_full"] <= 0.40),
            "invalid_io<=0.15": (g["invalid_io_ratio"], g["invalid_io_ratio"] <= 0.15),
        }
        key = "impress" if sel == "block" else "impress-token"
        if pk_acc:
            goals[sel]["passkey==dense"] = ((pk_acc.get(key), pk_acc.get("dense")), pk_acc.get(key) == pk_acc.get("dense"))
    return {"by_config": table, "first_token_all_questions": pooled, "passkey_accuracy": pk_acc, "goals_at_0.25_full": goals}


def markdown(result: dict[str, Any]) -> str:
    """The summary of a result file as Markdown tables (what the docs show)."""
    by = result["summary"]["by_config"]
    lines = [
        "| method | selection | decode | ratio | top-1 (teacher-forced) | first token | mean KL | prefill bytes / full | invalid I/O | fallback layers |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, v in sorted(by.items(), key=lambda kv: (float(kv[0].split("|")[3]), kv[0])):
        method, sel, dec, ratio = key.split("|")
        lines.append(
            f"| {method} | {sel} | {dec} | {ratio} | {v['top1_agreement']:.3f} | {v['first_token']:.2f} "
            f"| {v['mean_kl']:.4f} | {v['prefill_bytes_vs_full']:.3f} | {v['invalid_io_ratio']:.3f} | {v['fallback_layers']:.1f} |"
        )
    ft = result["summary"].get("first_token_all_questions", {})
    if ft:
        lines += [
            "",
            "| selection (ratio 0.25, decode full) | first token, all questions | prompts | misses | first-step KL (extra questions) |",
            "|---|---:|---:|---:|---:|",
        ]
        for sel, v in ft.items():
            lines.append(f"| {sel} | {v['first_token']:.3f} | {v['n']} | {v['misses']} | {v['mean_kl_first_extra']:.4f} |")
    pk = result["summary"]["passkey_accuracy"]
    lines += ["", "| passkey (10/50/90% depth of 4k tokens) | " + " | ".join(pk) + " |", "|---|" + "---:|" * len(pk)]
    lines.append("| accuracy | " + " | ".join(f"{v:.2f}" for v in pk.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/fidelity.json")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 7680])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--corpora", nargs="+", default=["prose", "code"])
    p.add_argument("--probe-dtype", default="int4", choices=["float16", "int8", "int4"])
    p.add_argument("--passkey-seeds", type=int, default=2)
    p.add_argument("--chunk-tokens", type=int, default=ImpressConfig().chunk_tokens, help="rows per disk block (default: the library default)")
    p.add_argument("--quick", action="store_true", help="1k and 2k prose only, block selection, ratio 0.25, 1 passkey seed")
    p.add_argument("--report", metavar="JSON", help="print the Markdown tables of an earlier run and exit")
    args = p.parse_args(argv)
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())))
        return 0
    if args.quick:
        args.lengths, args.ratios, args.corpora, args.passkey_seeds = [1024, 2048], [0.25], ["prose"], 1
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    print("loading SmolLM2-135M-Instruct...", file=sys.stderr)
    model, tok = load_smollm2()
    rows: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    # no memory tiers: every configuration reads its blocks from disk (guest-cold)
    base_cfg = dict(probe_dtype=args.probe_dtype, chunk_tokens=args.chunk_tokens, device_bytes=0, host_bytes=0)
    with tempfile.TemporaryDirectory(prefix="impress-fidelity-") as work:
        for kind in args.corpora:
            for length in args.lengths:
                print(f"prefix: {kind}, {length} tokens", file=sys.stderr, flush=True)
                r, sw = run_prefix(model, tok, kind, length, args.ratios, args.quick, base_cfg, Path(work))
                rows += r
                sweep += sw
        print("passkey test", file=sys.stderr, flush=True)
        pk = passkey(model, tok, [0.1, 0.5, 0.9], args.passkey_seeds, Path(work), base_cfg)
    result = {
        "meta": {
            "command": "python benchmarks/fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32), K/V stored in float32",
            "probe_dtype": args.probe_dtype,
            "chunk_tokens": args.chunk_tokens,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "disk": "guest-cold chunk files (fsync + POSIX_FADV_DONTNEED before every configuration)",
            "seconds": round(time.perf_counter() - t0, 1),
        },
        "summary": summarize(rows, pk, sweep),
        "rows": rows,
        "first_token_sweep": sweep,
        "passkey": pk,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out} in {result['meta']['seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
