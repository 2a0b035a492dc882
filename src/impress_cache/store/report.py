"""`ImpressStore.stats`: the counters of every room of the store in one dictionary."""

from __future__ import annotations

import copy
from typing import Any

from .blocks import IOCounters
from .gc import GCCounters
from .writer import WriteCounters


def build_stats(
    writes: WriteCounters,
    io: IOCounters,
    gc: GCCounters,
    tiers: dict[str, Any],
    policy: str,
    nodes: int,
    files: int,
    disk_bytes: int,
    disk_budget: int | None,
) -> dict[str, Any]:
    """See `ImpressStore.stats` for the meaning of every key."""
    t = copy.deepcopy(io)
    out: dict[str, Any] = dict(writes.__dict__)
    out.update(
        bytes_read_disk=t.bytes_read_disk,
        blocks_read=t.blocks_read,
        quarantined_files=gc.quarantined_files,
        nodes=nodes,
        files=files,
        disk_bytes=disk_bytes,
    )
    tiers["bytes_moved_between_tiers"] = tiers["bytes_promoted"] + tiers["bytes_demoted"]
    need = t.important_rows_needed
    mem = t.important_rows_device + t.important_rows_host
    lookups: dict[str, Any] = {}
    for kind, per_source in t.served.items():
        blocks = sum(v[0] for v in per_source.values())
        size = sum(v[1] for v in per_source.values())
        lookups[kind] = {"blocks": blocks, "bytes": size}
        for src, (b, n) in per_source.items():
            lookups[kind][src] = {
                "blocks": b,
                "bytes": n,
                "hit_ratio": b / blocks if blocks else 0.0,
                "byte_hit_ratio": n / size if size else 0.0,
            }

    def share(x: float) -> float:
        return x / need if need else 0.0

    out.update(
        policy=policy,
        tiers=tiers,
        lookups=lookups,
        kv_blocks_accessed=lookups["kv"]["blocks"],
        kv_bytes_accessed=lookups["kv"]["bytes"],
        important_rows_needed=need,
        important_rows_device=t.important_rows_device,
        important_rows_host=t.important_rows_host,
        important_rows_disk=max(0.0, need - mem),
        important_kv_hit_rate=share(mem),
        important_kv_device_hit_rate=share(t.important_rows_device),
        important_kv_host_hit_rate=share(t.important_rows_host),
        invalid_io_ratio=t.invalid_io_ratio,
        kv_bytes_read_disk=t.kv_bytes_read_disk,
        decode_bytes_read_disk=t.decode_bytes_read_disk,
        probe_bytes_read_disk=t.probe_bytes_read_disk,
        runs_direct_io=t.runs_direct_io,
        runs_buffered=t.runs_buffered,
        runs_direct_io_refused=t.runs_direct_io_refused,
        disk_budget=disk_budget,
        prefixes_evicted=gc.prefixes_evicted,
        files_evicted=gc.files_evicted,
        disk_bytes_evicted=gc.disk_bytes_evicted,
    )
    return out
