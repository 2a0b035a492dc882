"""The read path: blocks of a request step, from the memory tiers or the disk, into one pool.

One call plans once and goes one way: every distinct block is looked up in the memory
tiers in one batch (`TierManager.lookup`), the misses are read from disk in one batch
straight into their slots of the pool tensor (`BlockReader.read_into`), blocks read
from disk are offered to the tiers in one batch, and the call is accounted once. The
result is always a `BlockSet` of tensors.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..model_info import ModelSpec
from ..storage.base import KV, BlockKey
from ..storage.reader import BlockReader, Extent
from ..tiers import DEVICE, HOST, TierManager
from .blockset import BlockSet, ReadStats, invalid_io_ratio
from .catalog import Catalog

#: where a block lookup was served from
SOURCES = (DEVICE, HOST, "disk")


def _zero_sources() -> dict[str, dict[str, list[int]]]:
    return {kind: {src: [0, 0] for src in SOURCES} for kind in ("kv", "probe")}


@dataclass
class IOCounters:
    """Totals of every read since the store was opened (or since `reset_stats`)."""

    bytes_read_disk: int = 0
    blocks_read: int = 0
    #: ``served[kind][source] = [blocks, bytes]``, kind ``"kv"`` or ``"probe"``
    served: dict[str, dict[str, list[int]]] = field(default_factory=_zero_sources)
    decode_blocks: int = 0
    important_rows_needed: float = 0.0
    important_rows_device: float = 0.0
    important_rows_host: float = 0.0
    kv_bytes_read_disk: int = 0
    kv_bytes_unattended: float = 0.0
    decode_bytes_read_disk: int = 0
    probe_bytes_read_disk: int = 0

    @property
    def invalid_io_ratio(self) -> float:
        return invalid_io_ratio(self.kv_bytes_unattended, self.kv_bytes_read_disk)


def clip_share(share: float | None) -> float:
    """An importance share in ``[0, 1]``; unknown (``None``/NaN) counts as fully used."""
    if share is None:
        return 1.0
    s = float(share)
    return 1.0 if math.isnan(s) else min(1.0, max(0.0, s))


class BlockIO:
    """Reads blocks for requests and keeps the store's I/O counters."""

    def __init__(
        self,
        catalog: Catalog,
        tiers: TierManager,
        spec: ModelSpec,
        probe_record_bytes: int,
        reader: BlockReader,
        on_access: Callable[[Iterable[BlockKey]], None],
        pin_host: bool = False,
    ) -> None:
        self._catalog = catalog
        self._tiers = tiers
        self._spec = spec
        self._probe_record = probe_record_bytes
        self._reader = reader
        self._on_access = on_access
        self._pin_host = pin_host
        self._lock = threading.Lock()
        self.counters = IOCounters()

    def reset(self) -> None:
        with self._lock:
            self.counters = IOCounters()

    def read(
        self,
        keys: Sequence[BlockKey],
        shares: Sequence[float | None] | None = None,
        *,
        decode: bool = False,
        known: Mapping[BlockKey, torch.Tensor] | None = None,
    ) -> BlockSet:
        """Blocks ``(file_id, kind, layer, block)`` of one kind, memory tiers first.

        Parameters
        ----------
        keys:
            Blocks to read; duplicates are read (and counted) once.
        shares:
            Per key, the fraction of the block's rows the request attends to (its
            importance share, in ``[0, 1]``); ``None`` means all rows. Probe pieces
            always count as fully used.
        decode:
            K/V blocks read only to decode after a sparse prefill that did not select
            them: their accesses count with share 0 and they are left out of the
            importance metrics (important-KV hit rate, invalid I/O).
        known:
            Blocks this request already holds (``key -> block``): copied into the pool
            without a lookup, a read or an access.

        Raises
        ------
        CorruptBlockError
            Naming the file of a missing or damaged block.
        """
        t0 = time.perf_counter()
        keys = list(keys)
        if shares is not None and len(shares) != len(keys):
            raise ValueError(f"shares must have one entry per key: {len(shares)} shares for {len(keys)} keys")
        kinds = {k[1] for k in keys}
        if len(kinds) > 1:
            raise ValueError("read one kind of block per call (K/V or probe pieces)")
        kind = kinds.pop() if kinds else KV
        slot_of: list[int] = []
        unique: dict[BlockKey, int] = {}
        share_of: list[float] = []
        for i, key in enumerate(keys):
            slot = unique.setdefault(key, len(unique))
            if slot == len(share_of):
                share = 0.0 if decode and kind == KV else (1.0 if kind != KV or shares is None else clip_share(shares[i]))
                share_of.append(share)
            slot_of.append(slot)
        slot_keys = list(unique)
        files = [self._catalog.open_file(k[0]) for k in slot_keys]
        infos = [f.info(k) for f, k in zip(files, slot_keys)]
        rows = [info.rows for info in infos]
        pool = self._pool(kind, len(slot_keys), max(rows, default=1))
        known = known or {}
        todo = [s for s, k in enumerate(slot_keys) if k not in known]
        for s, k in enumerate(slot_keys):
            if k in known:
                self._place(pool, kind, s, known[k])
        found = self._tiers.lookup(
            [slot_keys[s] for s in todo], [share_of[s] for s in todo], [infos[s].nbytes for s in todo]
        )
        source: dict[int, str] = {}
        disk: list[int] = []
        for s, hit in zip(todo, found):
            if hit is None:
                disk.append(s)
            else:
                source[s] = hit[0]
                self._place(pool, kind, s, hit[1])
        nbytes = self._read_disk(pool, kind, disk, slot_keys, files, infos)
        if disk and self._tiers.enabled:
            self._tiers.admit(
                [(slot_keys[s], self._owned(pool, kind, s, rows[s]), infos[s].nbytes, share_of[s]) for s in disk],
                protect=slot_keys,
            )
        self._on_access(slot_keys[s] for s in todo)
        stats = self._account(kind, todo, source, disk, infos, share_of, nbytes, decode)
        stats.seconds = time.perf_counter() - t0
        return BlockSet(kind, pool, rows, slot_of, stats)

    # -- steps -----------------------------------------------------------------------
    def _pool(self, kind: int, slots: int, slot_rows: int) -> torch.Tensor:
        spec = self._spec
        if kind == KV:
            shape = (slots, 2, spec.num_kv_heads, slot_rows, spec.head_dim)
            return torch.empty(shape, dtype=spec.torch_kv_dtype)
        return torch.empty((slots, slot_rows, self._probe_record), dtype=torch.uint8)

    @staticmethod
    def _place(pool: torch.Tensor, kind: int, slot: int, block: torch.Tensor) -> None:
        if kind == KV:
            pool[slot, :, :, : block.shape[2]].copy_(block)
        else:
            pool[slot, : block.shape[0]].copy_(block)

    def _owned(self, pool: torch.Tensor, kind: int, slot: int, rows: int) -> torch.Tensor:
        """A block's own copy for the memory tiers (pinned when CUDA is available)."""
        view = pool[slot, :, :, :rows] if kind == KV else pool[slot, :rows]
        out = torch.empty(view.shape, dtype=view.dtype, pin_memory=self._pin_host)
        return out.copy_(view)

    def _read_disk(self, pool, kind, disk, slot_keys, files, infos) -> int:  # type: ignore[no-untyped-def]
        if not disk:
            return 0
        flat = pool.view(torch.uint8).reshape(-1).numpy()
        slot_bytes = flat.nbytes // pool.shape[0]
        mv = memoryview(flat)
        extents = [
            Extent(
                slot_keys[s][0], files[s].path, infos[s].offset, infos[s].nbytes, infos[s].checksum,
                mv[s * slot_bytes : (s + 1) * slot_bytes],
            )
            for s in disk
        ]
        nbytes = self._reader.read_into(extents)
        if kind == KV:
            spec = self._spec
            full = pool.shape[3]
            for s in disk:
                r = infos[s].rows
                if r < full:  # a short block landed at the start of its slot: spread its rows
                    raw = pool[s].reshape(-1)[: 2 * spec.num_kv_heads * r * spec.head_dim].clone()
                    pool[s, :, :, :r] = raw.view(2, spec.num_kv_heads, r, spec.head_dim)
        return nbytes

    def _account(self, kind, todo, source, disk, infos, share_of, nbytes, decode) -> ReadStats:  # type: ignore[no-untyped-def]
        stats = ReadStats(disk_bytes=nbytes, disk_blocks=len(disk), memory_blocks=len(source))
        label = "kv" if kind == KV else "probe"
        with self._lock:
            c = self.counters
            c.bytes_read_disk += nbytes
            c.blocks_read += len(disk)
            for s in todo:
                info = infos[s]
                src = source.get(s, "disk")
                cell = c.served[label][src]
                cell[0] += 1
                cell[1] += info.nbytes
                if kind != KV:
                    if src == "disk":
                        c.probe_bytes_read_disk += info.nbytes
                    continue
                if decode:
                    c.decode_blocks += 1
                    if src == "disk":
                        c.decode_bytes_read_disk += info.nbytes
                    continue
                important = share_of[s] * info.rows
                c.important_rows_needed += important
                if src == DEVICE:
                    c.important_rows_device += important
                elif src == HOST:
                    c.important_rows_host += important
                else:
                    unattended = info.nbytes * (1.0 - share_of[s])
                    c.kv_bytes_read_disk += info.nbytes
                    c.kv_bytes_unattended += unattended
                    stats.kv_disk_bytes += info.nbytes
                    stats.kv_unattended_bytes += unattended
        return stats
