"""Workload benchmark of the memory tiers: score vs LRU vs LFU on skewed prefix reuse.

    python benchmarks/workload.py --out results/workload.json --plot results/workload.png

What it does (everything seeded by ``--seed``):

1. Model: SmolLM2-135M-Instruct with its real weights, truncated to its first
   ``--layers`` (default 8) of 30 decoder layers. Those layers compute exactly what they
   compute in the full model, so their attention (and hence the probe-head selections)
   is the real, peaked attention of SmolLM2, and a block of K/V has SmolLM2's real size
   (``--chunk-tokens``, default 16: 16 tokens x 3 KV heads x 64 dims x K/V x fp16 = 12 KiB). The full 30-layer model
   would make the run about 4 times longer (over 30 minutes on this 2-core machine).
2. Corpus: ``--prefixes`` distinct prefixes of ``--min-tokens``..``--max-tokens`` SmolLM2
   tokens, half from ``pydoc_data.topics`` and half from standard-library ``.py``
   sources, stored once (K/V in fp16) in a base store.
3. Workloads: ``--requests`` requests per popularity law (Zipf with exponent
   ``--zipf-s`` and a normal law over a seeded ranking of the prefixes); every request is
   a stored prefix followed by a new question naming a word of that prefix.
4. Runs, on the same request sequence: the ``score``, ``lru`` and ``lfu`` policies with
   sparse loading (``important_ratio=0.25``, the prefill loads only the selected
   blocks, ``decode="keep"``); the AttentionStore-like baseline (``important_ratio=1.0``,
   whole prefixes, LRU); and recomputation without a store (on a seeded subsample of
   the requests, it is by far the slowest). Memory budgets: device 10 % and host 30 % of
   all stored K/V bytes. Each run starts from a copy of the base store (index copied,
   chunk files hard-linked), with empty tiers and no block statistics, and a simulated
   clock that advances ``--interval`` seconds per request (so the score policy's decay is
   reproducible). Before every request the chunk files are dropped from the page cache
   (``POSIX_FADV_DONTNEED``): disk reads are guest-cold.
5. Metrics after a warm-up of the first ``--warmup`` fraction of requests (statistics
   reset, tiers kept): device and host hit ratios of K/V block lookups, important-KV hit
   rates (device, and device + host), bytes read from disk, invalid-I/O ratio, and mean
   and p99 time to first token (``generate`` with ``max_new_tokens=1``, the cache built
   inside the timed region).

Writes a JSON file and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import re
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.storage.base import KV
from impress_cache.store import CHUNK_DIR, INDEX_NAME
from impress_cache.tools import drop_page_cache, load_smollm2

log = logging.getLogger("workload")

POLICY_RUNS = ("score", "lru", "lfu")
QUESTIONS = (
    "What does `{w}` mean in the text above?",
    "Where is `{w}` used in the text above, and why?",
    "Explain the role of `{w}` in one sentence.",
    "Which statement in the text above mentions `{w}`?",
    "Summarize what the text above says about `{w}`.",
)


class SimClock:
    """A clock the benchmark advances by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------- corpus
def _stdlib_sources(rng: random.Random) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.glob("*.py") if p.stat().st_size > 20_000 and not p.name.startswith("_")
    )
    rng.shuffle(files)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files[:60]]


def _pydoc_sources(rng: random.Random) -> list[str]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    rng.shuffle(names)
    return [topics[n] for n in names]


def build_prefixes(tok: Any, n: int, lo: int, hi: int, seed: int) -> list[dict[str, Any]]:
    """``n`` distinct token windows of ``lo..hi`` tokens, half pydoc text, half stdlib code."""
    rng = random.Random(seed)
    streams = {
        "pydoc_data.topics": tok("\n\n".join(_pydoc_sources(rng)), add_special_tokens=False)["input_ids"],
        "stdlib .py": tok("\n\n".join(_stdlib_sources(rng)), add_special_tokens=False)["input_ids"],
    }
    pos = {name: 0 for name in streams}
    firsts: set[int] = set()
    prefixes = []
    for i in range(n):
        source = list(streams)[i % 2]
        stream = streams[source]
        length = rng.randint(lo, hi)
        start = pos[source]
        # distinct first tokens: prefixes share no radix node
        while stream[start] in firsts:
            start += 1
        if start + length > len(stream):
            raise RuntimeError(f"the {source} text is too short for {n} prefixes of up to {hi} tokens")
        toks = stream[start : start + length]
        firsts.add(toks[0])
        pos[source] = start + length
        words = sorted(set(re.findall(r"[A-Za-z_][A-Za-z_0-9]{4,}", tok.decode(toks))))
        prefixes.append({"id": i, "source": source, "tokens": toks, "words": words or ["value"]})
    return prefixes


def build_requests(
    prefixes: list[dict[str, Any]], tok: Any, law: str, n_requests: int, seed: int, zipf_s: float
) -> list[dict[str, Any]]:
    """A seeded request sequence: a prefix per request by popularity law, plus a new question."""
    rng = random.Random(f"{seed}-{law}")
    n = len(prefixes)
    ranking = list(range(n))
    random.Random(f"{seed}-ranking").shuffle(ranking)  # same ranking for both laws
    if law == "zipf":
        weights = [1.0 / (r + 1) ** zipf_s for r in range(n)]
    elif law == "normal":
        mu, sigma = (n - 1) / 2, n / 6
        weights = [math.exp(-0.5 * ((r - mu) / sigma) ** 2) for r in range(n)]
    else:
        raise ValueError(law)
    requests = []
    for r in range(n_requests):
        rank = rng.choices(range(n), weights=weights)[0]
        p = prefixes[ranking[rank]]
        question = rng.choice(QUESTIONS).format(w=rng.choice(p["words"]))
        suffix = tok(f"\n\nQuestion {r + 1}: {question}\nAnswer:", add_special_tokens=False)["input_ids"]
        requests.append({"prefix": p["id"], "suffix": suffix})
    return requests


# ---------------------------------------------------------------------------- stores
def truncate(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """Keep the first ``layers`` decoder layers (their computation is unchanged)."""
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.generation_config.eos_token_id = None
    return model


def base_config(chunk_tokens: int, **kw: Any) -> ImpressConfig:
    return ImpressConfig(chunk_tokens=chunk_tokens, kv_dtype="float16", fsync=False, stats_interval_s=None, **kw)


def write_base_store(path: Path, model: torch.nn.Module, prefixes: list[dict[str, Any]], chunk_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ImpressStore(path, model, base_config(chunk_tokens, important_ratio=1.0)) as store:
        for p in prefixes:
            ids = torch.tensor([p["tokens"]])
            with torch.no_grad():
                out = model.model(input_ids=ids, use_cache=True)
            layers = out.past_key_values.layers
            store.put(p["tokens"], [layer.keys[0] for layer in layers], [layer.values[0] for layer in layers])
        kv = probe = 0
        for f in store.index.files():
            for (kind, _, _), info in store.index.blocks(f.id).items():
                if kind == KV:
                    kv += info.nbytes
                else:
                    probe += info.nbytes
        info = {
            "files": len(store.index.files()),
            "nodes": len(store.tree),
            "kv_bytes": kv,
            "probe_bytes": probe,
            "disk_bytes": store.disk_bytes(),
            "probe_heads": store.probe.kv_heads,
            "probe_dtype": store.probe.encoding,
            "write_seconds": round(time.perf_counter() - t0, 1),
        }
    os.sync()
    return info


def clone_store(base: Path, dst: Path) -> None:
    """A private copy: the index is copied, the (read-only) chunk files are hard-linked."""
    if dst.exists():
        shutil.rmtree(dst)
    (dst / CHUNK_DIR).mkdir(parents=True)
    for name in os.listdir(base):
        if name.startswith(INDEX_NAME):
            shutil.copy2(base / name, dst / name)
    for f in (base / CHUNK_DIR).iterdir():
        os.link(f, dst / CHUNK_DIR / f.name)


def _ttft(model: torch.nn.Module, ids: torch.Tensor, store: ImpressStore | None) -> float:
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs["past_key_values"] = ImpressCache(store, ids, store_prompt=False)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **kwargs)
    return time.perf_counter() - t0


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan"), "n": 0}
    s = sorted(values)
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    return {"mean": statistics.fmean(s), "p50": statistics.median(s), "p99": p99, "n": len(s)}


def run_store(
    name: str,
    base: Path,
    workdir: Path,
    model: torch.nn.Module,
    prefixes: list[dict[str, Any]],
    requests: list[dict[str, Any]],
    cfg: ImpressConfig,
    args: argparse.Namespace,
) -> dict[str, Any]:
    path = workdir / f"run-{name}"
    clone_store(base, path)
    clock = SimClock()
    warm = int(len(requests) * args.warmup)
    ttfts: list[float] = []
    disk_per_request: list[int] = []
    t0 = time.perf_counter()
    with ImpressStore(path, model, cfg, clock=clock) as store:
        for r, req in enumerate(requests):
            if r == warm:
                store.reset_stats()
            clock.t += args.interval
            ids = torch.tensor([prefixes[req["prefix"]]["tokens"] + req["suffix"]])
            if args.cold:
                drop_page_cache(path)
            before = store.stats()["bytes_read_disk"]
            dt = _ttft(model, ids, store)
            if cfg.decode == "full":
                # the rest of the prefix is read in the background after the prefill; wait
                # for it so that every run sees the same order of accesses
                store.fetcher.submit(lambda: None).result()
            if r >= warm:
                ttfts.append(dt)
                disk_per_request.append(store.stats()["bytes_read_disk"] - before)
        s = store.stats()
    shutil.rmtree(path)
    kv = s["lookups"]["kv"]
    result = {
        "config": {k: v for k, v in cfg.to_dict().items() if k in (
            "important_ratio", "decode", "selection", "policy", "device_bytes", "host_bytes",
            "half_life_s", "tier_shares", "probe_dtype", "probe_heads", "chunk_tokens", "kv_dtype", "unimportant_weight",
        )},
        "measured_requests": len(ttfts),
        "device_hit_ratio": kv["device"]["hit_ratio"],
        "host_hit_ratio": kv["host"]["hit_ratio"],
        "disk_ratio": kv["disk"]["hit_ratio"],
        "device_byte_hit_ratio": kv["device"]["byte_hit_ratio"],
        "host_byte_hit_ratio": kv["host"]["byte_hit_ratio"],
        "important_kv_device_hit_rate": s["important_kv_device_hit_rate"],
        "important_kv_hit_rate": s["important_kv_hit_rate"],
        "probe_device_hit_ratio": s["lookups"]["probe"]["device"]["hit_ratio"],
        "probe_host_hit_ratio": s["lookups"]["probe"]["host"]["hit_ratio"],
        "bytes_read_disk": s["bytes_read_disk"],
        "kv_bytes_read_disk": s["kv_bytes_read_disk"],
        "probe_bytes_read_disk": s["probe_bytes_read_disk"],
        "bytes_read_disk_per_request": s["bytes_read_disk"] / max(1, len(ttfts)),
        "prefill_bytes_read_disk": s["kv_bytes_read_disk"] + s["probe_bytes_read_disk"],
        "prefill_bytes_read_disk_per_request": (s["kv_bytes_read_disk"] + s["probe_bytes_read_disk"]) / max(1, len(ttfts)),
        "decode_bytes_read_disk": s["decode_bytes_read_disk"],
        "invalid_io_ratio": s["invalid_io_ratio"],
        "kv_bytes_accessed": s["kv_bytes_accessed"],
        "bytes_moved_between_tiers": s["tiers"]["bytes_moved_between_tiers"],
        "evictions": {t: s["tiers"][t]["evictions"] for t in ("device", "host")},
        "ttft_s": _summary(ttfts),
        "ttft_list_s": [round(x, 4) for x in ttfts],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    log.info(
        "%-9s device %.3f host %.3f imp-dev %.3f imp-mem %.3f disk %.1f MB ttft %.3f/%.3f s (%.0f s)",
        name, result["device_hit_ratio"], result["host_hit_ratio"], result["important_kv_device_hit_rate"],
        result["important_kv_hit_rate"], result["bytes_read_disk"] / 1e6, result["ttft_s"]["mean"],
        result["ttft_s"]["p99"], result["seconds"],
    )
    return result


def run_recompute(
    model: torch.nn.Module, prefixes: list[dict[str, Any]], requests: list[dict[str, Any]], args: argparse.Namespace, law: str
) -> dict[str, Any]:
    warm = int(len(requests) * args.warmup)
    pool = list(range(warm, len(requests)))
    picked = sorted(random.Random(f"{args.seed}-{law}-recompute").sample(pool, min(args.recompute_requests, len(pool))))
    t0 = time.perf_counter()
    ttfts = [
        _ttft(model, torch.tensor([prefixes[requests[r]["prefix"]]["tokens"] + requests[r]["suffix"]]), None)
        for r in picked
    ]
    out = {"requests": picked, "ttft_s": _summary(ttfts), "ttft_list_s": [round(x, 4) for x in ttfts],
           "bytes_read_disk": 0, "seconds": round(time.perf_counter() - t0, 1)}
    log.info("recompute ttft %.3f/%.3f s over %d requests", out["ttft_s"]["mean"], out["ttft_s"]["p99"], len(ttfts))
    return out


# ---------------------------------------------------------------------------- report
def goals(runs: dict[str, Any], score: str = "score") -> dict[str, Any]:
    """The issue's goals for the run ``score`` (a score-policy run) against LRU and LFU."""
    s, lru, lfu = runs[score], runs["lru"], runs["lfu"]
    gap = s["important_kv_device_hit_rate"] - lru["important_kv_device_hit_rate"]
    prefill = {"score": s["prefill_bytes_read_disk"], "lru": lru["prefill_bytes_read_disk"], "lfu": lfu["prefill_bytes_read_disk"]}
    return {
        "important_kv_device_hit_rate": {
            "score": s["important_kv_device_hit_rate"],
            "lru": lru["important_kv_device_hit_rate"],
            "lfu": lfu["important_kv_device_hit_rate"],
            "score_minus_lru_points": 100 * gap,
            "met": gap >= 0.10,
        },
        "bytes_read_disk": {
            "score": s["bytes_read_disk"],
            "lru": lru["bytes_read_disk"],
            "lfu": lfu["bytes_read_disk"],
            "met": s["bytes_read_disk"] < lru["bytes_read_disk"] and s["bytes_read_disk"] < lfu["bytes_read_disk"],
        },
        "prefill_bytes_read_disk": {
            **prefill,
            "met": prefill["score"] < prefill["lru"] and prefill["score"] < prefill["lfu"],
        },
    }


def _bars(ax: Any, groups: list[str], series: dict[str, list[float]], colors: dict[str, str], fmt: str) -> None:
    width = 0.8 / max(1, len(series))
    for j, (name, vals) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, vals, width, label=name, color=colors.get(name.split(" ")[0], "#444444"))
        ax.bar_label(bars, fmt=fmt, fontsize=6)
    ax.set_xticks(range(len(groups)), groups)
    top = max((v for vals in series.values() for v in vals), default=1.0)
    ax.set_ylim(0, top * 1.6 if top > 0 else 1.0)  # room for the legend


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    laws = list(result["workloads"])
    names = [*POLICY_RUNS, "as_like"]
    colors = {"score": "#1b9e77", "lru": "#d95f02", "lfu": "#7570b3", "as_like": "#999999", "recompute": "#e7298a"}
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    runs_of = {law: result["workloads"][law]["runs"] for law in laws}
    for ax, metric, title, scale, fmt in (
        (axes[0][0], "important_kv_device_hit_rate", "important-KV hit rate, device tier (%)", 100, "%.1f"),
        (axes[0][1], "important_kv_hit_rate", "important-KV hit rate, device + host (%)", 100, "%.1f"),
        (axes[1][0], "bytes_read_disk_per_request", "bytes read from disk per request (MB)", 1e-6, "%.2f"),
    ):
        _bars(ax, laws, {n: [runs_of[law][n][metric] * scale for law in laws] for n in names}, colors, fmt)
        ax.set_title(title, fontsize=10)
    axes[0][0].legend(fontsize=8)
    ax = axes[1][1]
    allnames = [*names, "recompute"]
    width = 0.8 / len(allnames)
    for j, name in enumerate(allnames):
        means, p99s = [], []
        for law in laws:
            w = result["workloads"][law]
            run = w["recompute"] if name == "recompute" else w["runs"][name]
            means.append(run["ttft_s"]["mean"] * 1e3)
            p99s.append(run["ttft_s"]["p99"] * 1e3)
        xs = [i + (j - (len(allnames) - 1) / 2) * width for i in range(len(laws))]
        ax.bar(xs, means, width, label=name, color=colors[name])
        ax.scatter(xs, p99s, marker="_", s=150, color="black", zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(range(len(laws)), laws)
    ax.set_title("time to first token (ms): mean (bar), p99 (dash)", fontsize=10)
    ax.legend(fontsize=8)
    full = {law: w["decode_full"]["runs"] for law, w in result["workloads"].items() if "decode_full" in w}
    if full:
        flaws = list(full)
        fnames = list(full[flaws[0]])
        shades = ("#66c2a5", "#a6d854", "#b3de69", "#ccebc5")
        colors |= {n: shades[i % len(shades)] for i, n in enumerate(x for x in fnames if x.startswith("score-w"))}
        _bars(
            axes[0][2], flaws,
            {f"{n} keep": [runs_of[law][n]["important_kv_device_hit_rate"] * 100 for law in flaws] for n in POLICY_RUNS}
            | {f"{n} full": [full[law][n]["important_kv_device_hit_rate"] * 100 for law in flaws] for n in fnames},
            colors, "%.1f",
        )
        for patch in axes[0][2].patches[len(POLICY_RUNS) * len(flaws):]:
            patch.set_hatch("//")
        axes[0][2].set_title("important-KV device hit rate (%): decode keep vs full (hatched)", fontsize=10)
        axes[0][2].legend(fontsize=6, ncol=3, loc="upper center")
        _bars(
            axes[1][2], flaws,
            {f"{n} prefill": [full[law][n]["prefill_bytes_read_disk_per_request"] * 1e-6 for law in flaws] for n in fnames}
            | {f"{n} total": [full[law][n]["bytes_read_disk_per_request"] * 1e-6 for law in flaws] for n in fnames},
            colors, "%.2f",
        )
        for patch in axes[1][2].patches[len(fnames) * len(flaws):]:
            patch.set_hatch("//")
        axes[1][2].set_title("decode='full': MB read from disk per request, prefill vs total (hatched)", fontsize=10)
        axes[1][2].legend(fontsize=6, ncol=2, loc="upper left")
    else:
        axes[0][2].axis("off")
        axes[1][2].axis("off")
    m = result["setup"]
    fig.suptitle(
        f"{m['model']['description']}; {m['corpus']['prefixes']} prefixes, {m['requests_per_workload']} requests per "
        f"workload ({m['warmup_requests']} warm-up); device {m['budgets']['device_fraction']:.0%} / host "
        f"{m['budgets']['host_fraction']:.0%} of stored K/V; {m['disk'].split(' (')[0]} disk; 'score' = "
        f"unimportant_weight {next(iter(result['workloads'].values()))['runs']['score']['config'].get('unimportant_weight', 0):g}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/workload.json"))
    ap.add_argument("--plot", type=Path, default=Path("results/workload.png"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=8, help="first SmolLM2 layers kept (of 30)")
    ap.add_argument("--prefixes", type=int, default=40)
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=160, help="requests per workload")
    ap.add_argument("--warmup", type=float, default=0.25, help="fraction of requests before statistics are reset")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--important-ratio", type=float, default=0.25)
    ap.add_argument("--device-fraction", type=float, default=0.10)
    ap.add_argument("--host-fraction", type=float, default=0.30)
    ap.add_argument("--interval", type=float, default=1.0, help="simulated seconds between requests")
    ap.add_argument("--recompute-requests", type=int, default=12)
    ap.add_argument("--workloads", default="zipf,normal")
    ap.add_argument("--full-decode-workloads", default="zipf",
                    help="workloads also run with decode='full' (comma-separated; '' for none)")
    ap.add_argument("--unimportant-weights", default="0,0.25,0.5,0.75",
                    help="more decode='full' runs of the score policy with these unimportant_weight values "
                         "(comma-separated; '' for none), beside the default one")
    ap.add_argument("--chunk-tokens", type=int, default=ImpressConfig().chunk_tokens, help="rows per disk block")
    ap.add_argument("--no-cold", dest="cold", action="store_false", help="keep chunk files in the page cache")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default: with 2 threads on 2 cores any other busy process "
                         "makes every step wait (measured 25x slower requests)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (not for reporting)")
    args = ap.parse_args(argv)
    weights = [float(w) for w in args.unimportant_weights.split(",") if w.strip()]
    if args.quick:
        args.prefixes, args.min_tokens, args.max_tokens, args.requests = 6, 256, 512, 24
        args.recompute_requests, args.layers = 3, 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("impress_cache").setLevel(logging.WARNING)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load0 = os.getloadavg()

    model, tok = load_smollm2()
    truncate(model, args.layers)
    prefixes = build_prefixes(tok, args.prefixes, args.min_tokens, args.max_tokens, args.seed)
    log.info("%d prefixes, %d tokens", len(prefixes), sum(len(p["tokens"]) for p in prefixes))

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="impress-workload-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base = workdir / "base"
    if base.exists():
        shutil.rmtree(base)
    stored = write_base_store(base, model, prefixes, args.chunk_tokens)
    log.info("base store: %s", stored)
    device_bytes = int(args.device_fraction * stored["kv_bytes"])
    host_bytes = int(args.host_fraction * stored["kv_bytes"])

    workloads: dict[str, Any] = {}
    for law in args.workloads.split(","):
        requests = build_requests(prefixes, tok, law, args.requests, args.seed, args.zipf_s)
        counts = [0] * len(prefixes)
        for r in requests:
            counts[r["prefix"]] += 1
        runs: dict[str, Any] = {}
        common = dict(device_bytes=device_bytes, host_bytes=host_bytes, decode="keep")
        for policy in POLICY_RUNS:
            cfg = base_config(args.chunk_tokens, important_ratio=args.important_ratio, policy=policy, **common)
            runs[policy] = run_store(f"{law}-{policy}", base, workdir, model, prefixes, requests, cfg, args)
        cfg = base_config(args.chunk_tokens, important_ratio=1.0, policy="lru", **common)
        runs["as_like"] = run_store(f"{law}-as_like", base, workdir, model, prefixes, requests, cfg, args)
        workloads[law] = {
            "requests_per_prefix": counts,
            "distinct_prefixes_used": sum(1 for c in counts if c),
            "top5_share": sum(sorted(counts, reverse=True)[:5]) / len(requests),
            "runs": runs,
            "recompute": run_recompute(model, prefixes, requests, args, law),
            "goals": goals(runs),
        }
        if law in args.full_decode_workloads.split(","):
            full: dict[str, Any] = {}
            common_full = {**common, "decode": "full"}
            for policy in POLICY_RUNS:
                cfg = base_config(args.chunk_tokens, important_ratio=args.important_ratio, policy=policy, **common_full)
                full[policy] = run_store(f"{law}-{policy}-full", base, workdir, model, prefixes, requests, cfg, args)
            for w in weights:
                name = f"score-w{w:g}"
                cfg = base_config(args.chunk_tokens, important_ratio=args.important_ratio, policy="score", unimportant_weight=w, **common_full)
                full[name] = run_store(f"{law}-{name}-full", base, workdir, model, prefixes, requests, cfg, args)
            workloads[law]["decode_full"] = {
                "runs": full,
                "goals": goals(full),
                "goals_weighted": {f"score-w{w:g}": goals(full, f"score-w{w:g}") for w in weights},
            }
    shutil.rmtree(base)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)

    lengths = [len(p["tokens"]) for p in prefixes]
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "seed": args.seed,
        "setup": {
            "model": {
                "description": f"SmolLM2-135M-Instruct, real weights, first {args.layers} of 30 layers",
                "layers": args.layers,
                "kv_heads": 3,
                "head_dim": 64,
                "kv_dtype": "float16",
                "kv_bytes_per_token": args.layers * 2 * 3 * 64 * 2,
                "used_for": "everything: stores, selections, hit ratios and TTFT",
            },
            "corpus": {
                "prefixes": len(prefixes),
                "sources": {src: sum(1 for p in prefixes if p["source"] == src) for src in ("pydoc_data.topics", "stdlib .py")},
                "tokens_total": sum(lengths),
                "tokens_min": min(lengths),
                "tokens_max": max(lengths),
                "tokens_mean": statistics.fmean(lengths),
            },
            "store": stored,
            "budgets": {
                "device_bytes": device_bytes,
                "host_bytes": host_bytes,
                "device_fraction": args.device_fraction,
                "host_fraction": args.host_fraction,
                "of": "all stored K/V bytes (probe copies are cached too and compete for the same budgets)",
            },
            "requests_per_workload": args.requests,
            "warmup_requests": int(args.requests * args.warmup),
            "zipf_s": args.zipf_s,
            "normal": "rank ~ N((n-1)/2, n/6) over a seeded ranking of the prefixes",
            "important_ratio": args.important_ratio,
            "simulated_seconds_between_requests": args.interval,
            "disk": "guest-cold (POSIX_FADV_DONTNEED on every chunk file before every request)" if args.cold else "warm page cache",
            "quick": args.quick,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg(),
        },
        "workloads": workloads,
        "notes": [
            "Why a truncated SmolLM2: the hit ratios depend on which blocks requests select, and random tiny "
            "models have diffuse attention, so their selections are close to arbitrary. The first layers of "
            "the real SmolLM2 compute exactly what they compute in the full model, so the probe-head "
            "selections here are SmolLM2's real ones for those layers, and a K/V block has SmolLM2's real size. "
            "Keeping all 30 layers would multiply the run time by ~4 (the store is written and every request "
            "is prefilled for real in every run) and not fit the 15-minute budget on 2 cores. Layers 8-29 are "
            "not represented; their selections may differ, and this run does not measure them.",
            "Every run uses the real request path (ImpressCache + generate with max_new_tokens=1); selections "
            "are recomputed in every run and are identical across runs (the tiers only change where bytes "
            "come from; the simulated clock makes the score decay reproducible).",
            "Main runs use decode='keep': only the blocks the prefill selects are ever read, so LRU and LFU "
            "also only ever see accesses to selected blocks: per-block access counts already encode importance, "
            "and the score policy behaves much like LFU. The 'decode_full' runs use decode='full': after the "
            "prefill every request also reads the blocks it did not select (to decode with the whole prefix), "
            "recorded as accesses with importance share 0. That is the paper's situation, where LRU/LFU see "
            "every chunk of a reused prefix; there the importance share is what tells the score policy which "
            "blocks matter for the next prefill. prefill_bytes_read_disk (K/V + probe blocks read before the "
            "first token) is what TTFT depends on; bytes_read_disk adds the decode reads.",
            "Probe-key copies go through the memory tiers like K/V blocks (share 1.0); bytes_read_disk counts both; "
            "kv_bytes_read_disk and probe_bytes_read_disk split them.",
            f"TTFT on this CPU is dominated by compute and Python overhead, not by I/O (blocks are {args.chunk_tokens * 3 * 64 * 2 * 2 // 1024} KiB: rows x KV heads x head dim x K/V x fp16; "
            "a guest-cold read of a whole 4k-token prefix of 8 layers is ~25 MB); other processes on the "
            "machine (see loadavg) add noise. Hit ratios and bytes are deterministic for a seed; times are not.",
            "Recompute TTFT is measured on a seeded subsample of the measured requests (recompute_requests).",
        ],
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.plot)
    log.info("wrote %s and %s in %.0f s", args.out, args.plot, result["seconds"])
    for law, w in workloads.items():
        log.info("%s goals: %s", law, json.dumps(w["goals"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
