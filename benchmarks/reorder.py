"""Importance reordering: bytes and agreement with and without it, on SmolLM2-135M.

    python benchmarks/reorder.py --out results/reorder.json           # ~8 min on 2 cores
    python benchmarks/reorder.py --quick --out /tmp/reorder-quick.json

Each prefix (``--length`` tokens of ``pydoc_data.topics`` prose or standard-library source)
is stored once (exact reuse). "Past" questions then reuse it sparsely (``important_ratio``
0.25, block selection), which records which rows their probe scores rank highest. The
store is copied: the copy is reorganised (`ImpressStore.reorganize` with the default
thresholds: every prefix has ``8 >= reorg_min_requests`` past requests), the original
stays in prompt order. Held-apart questions, which no past request asked, then reuse
both stores with the same settings:

* block selection at important_ratio 0.25, 0.2, 0.15 and 0.1;
* token selection at 0.25 (its rows do not depend on the layout, so its output is the
  same on both stores; only the blocks it touches change).

For every run: first-token agreement and teacher-forced top-1 agreement over ``--forced``
tokens with dense reuse (the dense greedy answer is fed back), mean KL, bytes read before
the first token (probe copies + K/V rows, from the request's counters), K/V blocks
touched per selected row and the read amplification of the rows (bytes of K/V blocks read
during the prefill / bytes of the selected rows). The chunk files are dropped from the
page cache before every run (fsync + ``POSIX_FADV_DONTNEED``: guest-cold). Reported too:
the rewrite's seconds and bytes per node, and how many later requests of a node's prefix
(block or token selection at 0.25) save as many bytes as the node's rewrite wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import compare, corpus_tokens, forced_run  # noqa: E402

from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.hf.compat import CACHE_KWARG  # noqa: E402
from impress_cache.tools import drop_page_cache, load_smollm2  # noqa: E402

QUESTIONS = {
    "prose": [
        "\n\nQuestion: In two sentences, what is the text above about?\nAnswer:",
        "\n\nQuestion: Which Python feature does the text above describe first?\nAnswer:",
        "\n\nSummarize the text above in one sentence.\nSummary:",
        "\n\nQuestion: Name one keyword that appears in the text above.\nAnswer:",
        "\n\nQ: Is the text above from a tutorial or from a reference manual?\nA:",
        "\n\nQuestion: Which statement is explained last in the text above?\nAnswer:",
        "\n\nQuestion: Give an example of an operator mentioned above.\nAnswer:",
        "\n\nList three terms defined in the text above.\n1.",
        # held apart: never asked before the reorganisation
        "\n\nQuestion: What does the text above say about exceptions?\nAnswer:",
        "\n\nExplain the text above to a beginner in one sentence.\nExplanation:",
        "\n\nQuestion: Which built-in types does the text above mention?\nAnswer:",
        "\n\nWrite a title for the text above.\nTitle:",
    ],
    "code": [
        "\n\n# Instruction: explain in two sentences what the code above does.\n# Explanation:",
        "\n\n# Question: which classes are defined above?\n# Answer:",
        "\n\n# Summary of the code above, in one sentence:\n#",
        "\n\n# Instruction: name two functions defined above.\n# Answer:",
        "\n\n# Q: what would be a good name for the file above?\n# A:",
        "\n\n# Question: which modules does the code above import?\n# Answer:",
        "\n\n# Question: what does the last function above return?\n# Answer:",
        "\n\n# Instruction: list the exceptions the code above raises.\n# Answer:",
        # held apart
        "\n\n# Question: is any of the code above recursive?\n# Answer:",
        "\n\n# Instruction: suggest one test for the code above.\n# Test:",
        "\n\n# Question: which public names does the code above export?\n# Answer:",
        "\n\n# Docstring for the first class above:\n\"\"\"",
    ],
}
PAST = 8
BLOCK_RATIOS = (0.25, 0.2, 0.15, 0.1)
# prefetch on: the setting results/reorder.json was measured with (the default before the
# answers benchmark turned it off); the bytes saved on reordered nodes come partly from it
BASE = {"chunk_tokens": 16, "device_bytes": 0, "host_bytes": 0, "reorg_idle_ms": None, "prefetch": True}


def prefixes(tok: Any, length: int, count: int) -> list[tuple[str, list[int]]]:
    """``count`` prefixes: prose at different offsets and slices of source code."""
    out = []
    code = corpus_tokens(tok, "code", length * ((count + 1) // 2))
    for i in range(count):
        if i % 2 == 0:
            out.append((f"prose-{i // 2}", corpus_tokens(tok, "prose", length, offset=37 * (i // 2))))
        else:
            out.append((f"code-{i // 2}", code[(i // 2) * length : (i // 2 + 1) * length]))
    return out


def ask(model: Any, store: ImpressStore, ids: torch.Tensor, forced: list[int]) -> dict[str, Any]:
    """One guest-cold teacher-forced run (see `fidelity.forced_run`)."""
    drop_page_cache(store.path)
    return forced_run(model, store, ids, forced)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--length", type=int, default=4096, help="tokens per prefix")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--forced", type=int, default=16, help="teacher-forced tokens per answer")
    p.add_argument("--quick", action="store_true", help="2 prefixes of 1024 tokens, 2 held-apart questions")
    p.add_argument("--work", type=Path, default=None, help="directory for the stores (default: a temporary one)")
    args = p.parse_args(argv)
    if args.quick:
        args.length, args.prefixes = 1024, 2
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    work = Path(tempfile.mkdtemp(prefix="reorder-", dir=args.work))
    try:
        result = run(model, tok, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    return 0


def run(model: Any, tok: Any, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    kv_row = 2 * model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * 4
    plain, ordered = work / "plain", work / "reordered"
    docs = prefixes(tok, args.length, args.prefixes)
    held_n = 2 if args.quick else len(QUESTIONS["prose"]) - PAST

    def ids_of(prefix: list[int], text: str) -> torch.Tensor:
        return torch.tensor([prefix + tok(text, add_special_tokens=False)["input_ids"]])

    # 1. store every prefix (exact), and the dense answers to the held-apart questions
    dense: dict[tuple[str, int], tuple[list[int], torch.Tensor]] = {}
    with ImpressStore(plain, model, ImpressConfig(important_ratio=1.0, **BASE)) as store:
        for name, prefix in tqdm(docs, desc="store + dense answers"):
            first = torch.tensor([prefix + [tok.eos_token_id or 0]])
            with torch.no_grad():
                model(first, use_cache=True, **{CACHE_KWARG: ImpressCache(store, first)})
            store.flush()
            kind = name.split("-")[0]
            for q in range(PAST, PAST + held_n):
                ids = ids_of(prefix, QUESTIONS[kind][q])
                with torch.no_grad():
                    gen = model.generate(
                        ids, max_new_tokens=args.forced, do_sample=False,
                        **{CACHE_KWARG: ImpressCache(store, ids, store_prompt=False)},
                    )
                greedy = gen[0, ids.shape[1] :].tolist()
                greedy += [greedy[-1]] * (args.forced - len(greedy))
                dense[(name, q)] = (greedy, ask(model, store, ids, greedy)["logp"])
    # 2. past questions, sparse: importance statistics
    past_cfg = ImpressConfig(important_ratio=0.25, selection="block", decode="keep", **BASE)
    with ImpressStore(plain, model, past_cfg) as store:
        for name, prefix in tqdm(docs, desc="past questions"):
            kind = name.split("-")[0]
            for q in range(PAST):
                forced_run(model, store, ids_of(prefix, QUESTIONS[kind][q]), [0])
    shutil.copytree(plain, ordered)
    # 3. reorganise the copy (default thresholds), timed
    with ImpressStore(ordered, model, ImpressConfig(**BASE)) as store:
        drop_page_cache(ordered)
        nodes = len(store.tree)
        t0 = time.perf_counter()
        reorg = store.reorganize()
        reorg["wall_seconds"] = time.perf_counter() - t0
        reorg["nodes_in_store"] = nodes
        reorg["bytes_read"] = store.stats()["reorg_bytes_read"]
    # 4. held-apart questions on both stores
    configs = [("block", r) for r in BLOCK_RATIOS] + [("token", 0.25)]
    rows = []
    for layout, path in (("prompt order", plain), ("reordered", ordered)):
        for sel, ratio in configs:
            conf = ImpressConfig(important_ratio=ratio, selection=sel, decode="keep", **BASE)
            with ImpressStore(path, model, conf) as store:
                for name, prefix in tqdm(docs, desc=f"{layout} {sel} {ratio}", leave=False):
                    kind = name.split("-")[0]
                    for q in range(PAST, PAST + held_n):
                        greedy, ref = dense[(name, q)]
                        res = ask(model, store, ids_of(prefix, QUESTIONS[kind][q]), greedy)
                        row = {"layout": layout, "selection": sel, "important_ratio": ratio, "prefix": name, "question": q}
                        row.update({k: v for k, v in res.items() if k != "logp"})
                        row.update(compare(ref, res["logp"], greedy))
                        row["bytes_before_first_token"] = res["bytes_read_probe"] + res["bytes_read_rows"]
                        row["selected_bytes"] = res["rows_selected"] * kv_row
                        row["read_amplification"] = res["bytes_read_rows"] / max(1, row["selected_bytes"])
                        rows.append(row)
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "model": "SmolLM2-135M-Instruct (fp32)",
        "measurement": "guest-cold: chunk files dropped from the page cache before every run",
        "settings": {"length": args.length, "prefixes": [n for n, _ in docs], "past_questions": PAST,
                     "held_apart_questions": held_n, "forced_tokens": args.forced, **BASE},
        "reorganisation": reorg,
        "summary": summarize(rows, reorg),
        "runs": rows,
    }


def summarize(rows: list[dict[str, Any]], reorg: dict[str, Any]) -> dict[str, Any]:
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["layout"], r["selection"], r["important_ratio"]), []).append(r)
    table = []
    for (layout, sel, ratio), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], -kv[0][2], kv[0][0])):
        table.append({
            "layout": layout, "selection": sel, "important_ratio": ratio, "runs": len(rs),
            "bytes_before_first_token": statistics.mean(r["bytes_before_first_token"] for r in rs),
            "first_token": statistics.mean(r["first_token"] for r in rs),
            "top1_agreement": statistics.mean(r["top1_agreement"] for r in rs),
            "mean_kl": statistics.mean(r["mean_kl"] for r in rs),
            "blocks_per_selected_row": statistics.mean(r["blocks_per_selected_row"] for r in rs),
            "read_amplification": statistics.mean(r["read_amplification"] for r in rs),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
        })

    def cell(layout: str, sel: str, ratio: float) -> dict[str, Any]:
        return next(t for t in table if (t["layout"], t["selection"], t["important_ratio"]) == (layout, sel, ratio))

    base = cell("prompt order", "block", 0.25)
    # block selection: the cheapest reordered setting that agrees at least as well as 0.25 in prompt order
    ok = [
        t for t in table
        if t["layout"] == "reordered" and t["selection"] == "block"
        and t["top1_agreement"] >= base["top1_agreement"] and t["first_token"] >= base["first_token"]
    ]
    best = min(ok, key=lambda t: t["bytes_before_first_token"]) if ok else None
    same = cell("reordered", "block", 0.25)
    tok_plain, tok_re = cell("prompt order", "token", 0.25), cell("reordered", "token", 0.25)
    rewritten = max(1, reorg["rewritten"])
    per_node = reorg["bytes_rewritten"] / rewritten
    # bytes one later request of the node's prefix saves (each run reuses one prefix = one node)
    saved_block = base["bytes_before_first_token"] - same["bytes_before_first_token"]
    saved_token = tok_plain["bytes_before_first_token"] - tok_re["bytes_before_first_token"]
    return {
        "table": table,
        "block_equal_agreement": None if best is None else {
            "important_ratio": best["important_ratio"],
            "bytes_ratio": best["bytes_before_first_token"] / base["bytes_before_first_token"],
            "top1_agreement": best["top1_agreement"], "first_token": best["first_token"],
        },
        "block_equal_bytes": {
            "bytes_ratio": same["bytes_before_first_token"] / base["bytes_before_first_token"],
            "top1_agreement_plain": base["top1_agreement"], "top1_agreement_reordered": same["top1_agreement"],
            "first_token_plain": base["first_token"], "first_token_reordered": same["first_token"],
        },
        "token_read_amplification": {"prompt order": tok_plain["read_amplification"], "reordered": tok_re["read_amplification"]},
        "token_bytes_ratio": tok_re["bytes_before_first_token"] / tok_plain["bytes_before_first_token"],
        "rewrite_seconds_per_node": reorg["wall_seconds"] / rewritten,
        "rewrite_bytes_per_node": per_node,
        # requests of a node's prefix until the bytes saved repay the node's rewrite
        "payback_requests_block_0.25": per_node / saved_block if saved_block > 0 else None,
        "payback_requests_token_0.25": per_node / saved_token if saved_token > 0 else None,
    }


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        "| selection | ratio | layout | bytes before 1st token (MB) | first token | top-1 agreement | mean KL | blocks / selected row | read amplification |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in s["table"]:
        lines.append(
            f"| {t['selection']} | {t['important_ratio']} | {t['layout']} | {t['bytes_before_first_token'] / 1e6:.2f} | "
            f"{t['first_token']:.2f} | {t['top1_agreement']:.3f} | {t['mean_kl']:.3f} | "
            f"{t['blocks_per_selected_row']:.4f} | {t['read_amplification']:.2f} |"
        )
    r = result["reorganisation"]
    lines.append("")
    lines.append(
        f"Rewrote {r['rewritten']} of {r['nodes_in_store']} nodes in {r['wall_seconds']:.2f} s "
        f"({s['rewrite_seconds_per_node']:.2f} s, {s['rewrite_bytes_per_node'] / 1e6:.1f} MB per node)."
    )
    lines.append(json.dumps({k: v for k, v in s.items() if k != "table"}, indent=2))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
