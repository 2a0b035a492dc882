"""The read path: blocks of a request step, from the memory tiers or the disk, into one pool.

One call plans once and goes one way: the blocks are deduplicated and given pool slots in
file order (with numpy, no per-block Python objects when the memory tiers are off), the
memory tiers are asked in one batch (`TierManager.lookup`, skipped entirely when both
budgets are 0), the misses are read from disk in one batch straight into their slots
(`BlockReader.submit`), blocks read from disk are offered to the tiers in one batch, and
the call is accounted once. `start` returns at once with the disk reads in flight;
`PendingRead.result` waits for them and returns a `BlockSet` of tensors.

A store with a ``kv_codec`` reads its encoded K/V blocks into a byte buffer of their own
and decodes them into the pool's slots when the read finishes (runs of whole slots in
one call each): the pool, the memory tiers and everything above see dense blocks in the
store's dtype, and the tiers count their decoded bytes.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..model_info import ModelSpec
from ..storage import kv_codec
from ..storage.base import KV, BlockKey, block_code
from ..storage.reader import BlockReader, DirectCounts, FileBlocks, ReadBatch, release_all
from ..tiers import DEVICE, HOST, TierManager
from .blockset import BlockSet, ReadStats, invalid_io_ratio
from . import direct
from .catalog import Catalog
from .layout import PrefixLayout
from .slabs import Slabs

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
    #: runs of exact reuse's direct reads (`store.direct`) read with ``O_DIRECT``, through
    #: the page cache, and refused by the file system (`reader.DirectCounts`)
    runs_direct_io: int = 0
    runs_buffered: int = 0
    runs_direct_io_refused: int = 0

    @property
    def invalid_io_ratio(self) -> float:
        return invalid_io_ratio(self.kv_bytes_unattended, self.kv_bytes_read_disk)


def clip_share(share: float | None) -> float:
    """An importance share in ``[0, 1]``; unknown (``None``/NaN) counts as fully used."""
    if share is None:
        return 1.0
    s = float(share)
    return 1.0 if math.isnan(s) else min(1.0, max(0.0, s))


@dataclass
class _Plan:
    """One read, planned: slot ``s`` holds block ``(files[s], kind, layers[s], blocks[s])``."""

    kind: int
    files: np.ndarray
    layers: np.ndarray
    blocks: np.ndarray
    rows: np.ndarray
    nbytes: np.ndarray
    shares: np.ndarray
    slot_of: list[int]
    decode: bool
    pool: torch.Tensor
    keys: list[BlockKey] | None = None
    held: dict[int, torch.Tensor] = field(default_factory=dict)
    source: dict[int, str] = field(default_factory=dict)
    disk: np.ndarray | None = None
    batch: ReadBatch | None = None
    t0: float = 0.0
    #: maintenance read: nothing counted
    quiet: bool = False
    #: with a ``kv_codec``: the encoded K/V blocks as read, ``uint8 [slots, slot bytes]``
    raw: torch.Tensor | None = None
    #: bytes of each slot's block in memory (decoded), when they differ from ``nbytes``
    mem_nbytes: np.ndarray | None = None

    @property
    def tier_nbytes(self) -> np.ndarray:
        return self.nbytes if self.mem_nbytes is None else self.mem_nbytes


class PendingRead:
    """A read whose disk part is in flight; `result` finishes it."""

    def __init__(self, io: BlockIO, plan: _Plan) -> None:
        self._io = io
        self._plan = plan
        self._result: BlockSet | None = None

    def result(self, shares: Sequence[float] | None = None) -> BlockSet:
        """Wait for the disk reads and return the blocks. ``shares`` (one per key asked
        for) replaces the importance shares the read was started with, for its
        accounting: a read started before the request knew which rows it would use (a
        prefetch) is accounted with what it turned out to be worth."""
        if self._result is None:
            if shares is not None:
                plan = self._plan
                per_slot = np.zeros(len(plan.nbytes))
                per_slot[np.asarray(plan.slot_of, dtype=np.int64)] = [clip_share(x) for x in shares]
                plan.shares = per_slot
            self._result = self._io._finish(self._plan)
        return self._result


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
        fill: Any = None,
        direct_io: bool | str = "auto",
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
        #: runs of K/V blocks admitted together, held contiguously (`slabs`)
        self.slabs = Slabs(tiers, pin_host)
        #: ``fill(file_id, name, offsets, sizes)`` makes blocks of a file present before they
        #: are read, for files where ``fill.linked(name)`` (the remote tier's linked files,
        #: `RemoteFiles`); ``None``: every file is whole
        self.fill = fill
        #: exact reuse's direct reads use ``O_DIRECT`` where the file system allows it
        #: (`ImpressConfig.direct_io`)
        self.direct_io = direct_io

    def reset(self) -> None:
        with self._lock:
            self.counters = IOCounters()

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    def start_rows(self, layout: PrefixLayout, layer: int, out: torch.Tensor) -> direct.RowsRead | None:
        """Start reading every row of ``layer`` of ``layout`` from disk straight into
        ``out`` (``[2, kv_heads, positions, head_dim]``; `store.direct`), with the memory
        tiers off; ``None`` where the pool path must read them (`start_layout`)."""
        if self._tiers.enabled:
            return None
        return direct.start_rows(self, self._spec, self._reader, layout, layer, out)

    def count_disk_kv(self, disk_bytes: int, blocks: int, rows: int, payload: int, runs: DirectCounts) -> None:
        """Count a dense read of K/V blocks from disk in the store's totals (as `_account`
        counts one through the pool: every row attended), and how its runs were read."""
        with self._lock:
            c = self.counters
            c.runs_direct_io += runs.direct
            c.runs_buffered += runs.buffered
            c.runs_direct_io_refused += runs.refused
            c.bytes_read_disk += disk_bytes
            c.blocks_read += blocks
            cell = c.served["kv"]["disk"]
            cell[0] += blocks
            cell[1] += payload
            c.important_rows_needed += rows
            c.kv_bytes_read_disk += payload

    def where(self, layout: PrefixLayout, sample: int = 64) -> tuple[float, bool]:
        """Where a prefix's blocks are, for the cost model: the share of a sample of its
        first layer's K/V blocks held by a memory tier (no access recorded), and whether a
        file of it may still fetch blocks from the remote tier."""
        units = layout.units
        if not units:
            return 0.0, False
        step = max(1, len(units) // sample)
        keys = [(u.file_id, KV, 0, u.block) for u in units[::step]]
        resident = self._tiers.resident(keys) / len(keys) if self._tiers.enabled else 0.0
        linked = False
        if self.fill is not None:
            for fid in set(layout.unit_files.tolist()):
                rec = self._catalog.records.get(fid)
                if rec is not None and self.fill.linked(rec.name, fid):
                    linked = True
                    break
        return resident, linked

    def resident_rows(self, layout: PrefixLayout, layer: int) -> list[torch.Tensor] | None:
        """Every row of ``layer`` of an in-order ``layout`` as views of intact slabs (one
        ``[2, kv_heads, rows, head_dim]`` view per segment, in order), accounted as memory
        hits of their blocks, or ``None`` (some segment is not in one slab: read it)."""
        if not self._tiers.enabled or not layout.in_order:
            return None
        views: list[torch.Tensor] = []
        hits = []
        for file_id, chunk, r0, n in layout.parts():
            got = self.slabs.rows(file_id, layer, r0, n, chunk)
            if got is None:  # (segments served before count their hits twice: a rare race
                return None  # with an eviction between two segments, statistics only)
            views.extend(g[0] for g in got)
            hits.extend(got)
        row_bytes = self._spec.kv_row_bytes
        with self._lock:
            c = self.counters
            for _, tier, keys, rows in hits:
                cell = c.served["kv"][tier]
                cell[0] += len(keys)
                cell[1] += rows * row_bytes
                c.important_rows_needed += rows
                if tier == DEVICE:
                    c.important_rows_device += rows
                else:
                    c.important_rows_host += rows
        for _, _, keys, _ in hits:
            self._on_access(keys)
        return views

    # -- entry points ----------------------------------------------------------------------
    def read(
        self,
        keys: Sequence[BlockKey],
        shares: Sequence[float | None] | None = None,
        *,
        decode: bool = False,
        known: Mapping[int, torch.Tensor] | None = None,
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
            Blocks of this kind the request already holds (`block_code` -> block, a
            ``[2, kv_heads, rows, head_dim]`` or ``[rows, record]`` tensor, possibly with
            more rows than the block has): copied into the pool without a lookup, a read
            or an access.

        Raises
        ------
        CorruptBlockError
            Naming the file of a missing or damaged block.
        """
        kinds = {k[1] for k in keys}
        if len(kinds) > 1:
            raise ValueError("read one kind of block per call (K/V or probe pieces)")
        if shares is not None and len(shares) != len(keys):
            raise ValueError(f"shares must have one entry per key: {len(shares)} shares for {len(keys)} keys")
        arr = np.asarray(keys, dtype=np.int64).reshape(-1, 4)
        return self._start(
            kinds.pop() if kinds else KV, arr[:, 0], arr[:, 2], arr[:, 3], shares, decode, known
        ).result()

    def start_layout(
        self,
        layout: PrefixLayout,
        kind: int,
        layers: Sequence[int],
        units: Sequence[int] | None = None,
        shares: Sequence[float | None] | None = None,
        *,
        decode: bool = False,
        known: Mapping[int, torch.Tensor] | None = None,
        place_hits: bool = True,
        quiet: bool = False,
        inline: bool = False,
    ) -> PendingRead:
        """Start reading the blocks of ``units`` (default: all) of ``layout`` for every layer
        in ``layers``; key ``i * len(units) + j`` is unit ``units[j]`` of ``layers[i]``.
        ``shares`` has one entry per unit (the same in every layer). With
        ``place_hits=False`` memory-tier hits are not copied into the pool but held
        (`BlockSet.held`): a caller that copies blocks out once (`gather_into`) saves a copy.
        A ``quiet`` read (maintenance) goes straight to disk: no memory tiers, no block
        statistics, no I/O counters. An ``inline`` read runs its disk part in the calling
        thread, every run asked for from the kernel first (`BlockReader.submit`): a sparse
        layer's chosen blocks, which the request waits for anyway, where handing each run
        to the reader threads costs more than the read."""
        u = np.arange(len(layout.units)) if units is None else np.asarray(units, dtype=np.int64)
        files = np.tile(layout.unit_files[u], len(layers))
        blocks = np.tile(layout.unit_blocks[u], len(layers))
        lay = np.repeat(np.asarray(layers, dtype=np.int64), len(u))
        per_key = None if shares is None else list(shares) * len(layers)
        return self._start(kind, files, lay, blocks, per_key, decode, known, place_hits, quiet, inline)

    # -- steps -----------------------------------------------------------------------
    def _start(self, kind, files, layers, blocks, shares, decode, known, place_hits=True, quiet=False, inline=False) -> PendingRead:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        code = block_code(files, layers, blocks)
        uniq, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        s_files, s_layers, s_blocks = files[first], layers[first], blocks[first]
        n = len(uniq)
        rows = np.zeros(n, dtype=np.int64)
        groups = np.flatnonzero(np.r_[True, s_files[1:] != s_files[:-1]]) if n else np.zeros(0, np.int64)
        bounds = [*groups.tolist(), n]
        tables = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            f = self._catalog.open_file(int(s_files[a]))
            rows[a:b] = f.table.rows[s_blocks[a:b]]
            tables.append((a, b, f))
        if kind == KV and decode:
            share_arr = np.zeros(n)
        elif kind != KV or shares is None:
            share_arr = np.ones(n)
        else:
            share_arr = np.array([clip_share(shares[i]) for i in first.tolist()], dtype=np.float64)
        row_bytes = self._spec.kv_row_bytes if kind == KV else self._probe_record
        nbytes = rows * row_bytes
        slot_rows = int(rows.max()) if n else 1
        plan = _Plan(
            kind, s_files, s_layers, s_blocks, rows, nbytes, share_arr, inverse.tolist(), decode,
            self._pool(kind, n, slot_rows), t0=t0, quiet=quiet,
        )
        if kind == KV and self._spec.kv_codec is not None:
            plan.mem_nbytes = rows * self._spec.dense_row_bytes
        disk = np.ones(n, dtype=bool)
        if known:
            held = [(s, known[c]) for s, c in enumerate(uniq.tolist()) if c in known]
            self._place_many(plan.pool, kind, held)
            for s, _ in held:
                disk[s] = False
                plan.source[s] = "known"
        if self._tiers.enabled and not quiet:
            plan.keys = list(zip(s_files.tolist(), itertools.repeat(kind), s_layers.tolist(), s_blocks.tolist()))
        if self._tiers.enabled and plan.keys is not None:
            todo = np.flatnonzero(disk).tolist()
            found = self._tiers.lookup(
                [plan.keys[s] for s in todo], share_arr[todo].tolist(), plan.tier_nbytes[todo].tolist()
            )
            hits = [(s, hit[1]) for s, hit in zip(todo, found) if hit is not None]
            if kind == KV and not place_hits:  # a dense layer: runs of hits in no slab become one
                self.slabs.regroup(hits, s_files, s_layers, s_blocks, plan.keys, slot_rows)
            if not place_hits:  # blocks on the pool's device are used where they are
                plan.held.update((slot, b) for slot, b in hits if b.device == plan.pool.device)
            self._place_many(plan.pool, kind, [(slot, b) for slot, b in hits if slot not in plan.held])
            for s, hit in zip(todo, found):
                if hit is not None:
                    plan.source[s] = hit[0]
                    disk[s] = False
        plan.disk = np.flatnonzero(disk)
        if len(plan.disk) and plan.mem_nbytes is not None:  # encoded blocks land in a buffer of their own
            plan.raw = torch.empty((n, slot_rows * row_bytes), dtype=torch.uint8)
        if len(plan.disk):
            flat = (plan.pool if plan.raw is None else plan.raw).view(torch.uint8).reshape(-1).numpy()
            slot_bytes = flat.nbytes // max(1, n)
            work: list[FileBlocks] = []
            try:
                for a, b, f in tables:
                    sel = plan.disk[(plan.disk >= a) & (plan.disk < b)]
                    if not len(sel):
                        continue
                    t = f.table
                    la, bl = s_layers[sel], s_blocks[sel]
                    offsets = t.offsets[kind, la, bl]
                    before = None if self.fill is None or not self.fill.linked(f.record.name, f.record.id) \
                        else functools.partial(self.fill.fill, f.record.id, f.record.name, offsets, nbytes[sel])
                    loan = self._catalog.lend(f)  # (open until the reader releases it: `BlockReader.submit`)
                    work.append(FileBlocks(
                        f.record.id, f.path, None if loan is None else loan.fd, offsets, nbytes[sel],
                        t.checksums[kind, la, bl], t.seeds[kind, la, bl], sel * slot_bytes, before,
                        done=None if loan is None else loan.release,
                    ))
            except BaseException:
                release_all(work)
                raise
            plan.batch = self._reader.submit(work, memoryview(flat), inline=inline)
        return PendingRead(self, plan)

    def _finish(self, plan: _Plan) -> BlockSet:
        nbytes_disk = plan.batch.wait() if plan.batch is not None else 0
        pool, kind = plan.pool, plan.kind
        assert plan.disk is not None
        if plan.raw is not None and len(plan.disk):
            self._decode(plan)
        elif kind == KV and len(plan.disk):
            spec, full = self._spec, pool.shape[3]
            for s in plan.disk[plan.rows[plan.disk] < full].tolist():
                r = int(plan.rows[s])  # a short block landed at the start of its slot: spread its rows
                raw = pool[s].reshape(-1)[: 2 * spec.num_kv_heads * r * spec.head_dim].clone()
                pool[s, :, :, :r] = raw.view(2, spec.num_kv_heads, r, spec.head_dim)
        if plan.keys is not None:
            if len(plan.disk):
                disk = plan.disk.tolist()
                if kind == KV:  # runs of a (file, layer) share one slab
                    payloads, runs = self.slabs.form(pool, plan.disk, plan.files, plan.layers, plan.blocks, plan.rows)
                else:
                    payloads, runs = [self._owned(pool, kind, s, int(plan.rows[s])) for s in disk], []
                keys = [plan.keys[s] for s in disk]
                self._tiers.admit(
                    [(k, p, int(plan.tier_nbytes[s]), float(plan.shares[s])) for k, p, s in zip(keys, payloads, disk)],
                    protect=plan.keys,
                )
                if runs:
                    self.slabs.bind(runs, keys, payloads)
            self._on_access(k for s, k in enumerate(plan.keys) if plan.source.get(s) != "known")
        stats = self._account(plan, nbytes_disk)
        stats.seconds = time.perf_counter() - plan.t0
        return BlockSet(kind, pool, plan.rows.tolist(), plan.slot_of, stats, plan.held)

    def _decode(self, plan: _Plan) -> None:
        """Decode the encoded K/V blocks read from disk into their pool slots: each run of
        consecutive whole slots with one call, a short block (a file's last) alone."""
        pool, raw, codec = plan.pool, plan.raw, self._spec.kv_codec
        assert raw is not None and plan.disk is not None and codec is not None
        n, _, h, s_rows, d = pool.shape
        coded = raw.view(n, 2, h, s_rows, d + kv_codec.SCALE_BYTES)
        disk = plan.disk
        whole = disk[plan.rows[disk] == s_rows]
        if len(whole):
            for run in np.split(whole, np.flatnonzero(np.diff(whole) != 1) + 1):
                lo, hi = int(run[0]), int(run[-1]) + 1
                kv_codec.decode_into(coded[lo:hi], pool[lo:hi], codec)
        for s in disk[plan.rows[disk] < s_rows].tolist():
            r = int(plan.rows[s])  # a short block landed at the start of its slot
            src = raw[s, : r * self._spec.kv_row_bytes].view(2, h, r, d + kv_codec.SCALE_BYTES)
            kv_codec.decode_into(src, pool[s, :, :, :r], codec)

    def _pool(self, kind: int, slots: int, slot_rows: int) -> torch.Tensor:
        spec = self._spec
        if kind == KV:
            return torch.empty((slots, 2, spec.num_kv_heads, slot_rows, spec.head_dim), dtype=spec.torch_kv_dtype)
        return torch.empty((slots, slot_rows, self._probe_record), dtype=torch.uint8)

    @staticmethod
    def _place_many(pool: torch.Tensor, kind: int, blocks: list[tuple[int, torch.Tensor]]) -> None:
        """Copy blocks into their slots: whole-slot blocks with one stacked copy, the rest
        one by one (a block may carry more rows than the slot uses)."""
        rows_dim = 2 if kind == KV else 0
        s = pool.shape[rows_dim + 1]
        whole = [(slot, b) for slot, b in blocks if b.shape[rows_dim] == s and b.device == pool.device]
        i = 0
        while i < len(whole):  # runs of consecutive slots: one stack straight into the pool
            j = i + 1
            while j < len(whole) and whole[j][0] == whole[j - 1][0] + 1:
                j += 1
            lo = whole[i][0]
            torch.stack([b for _, b in whole[i:j]], out=pool[lo : lo + j - i])
            i = j
        for slot, b in blocks:
            r = b.shape[rows_dim]
            if r == s and b.device == pool.device:
                continue
            r = min(r, s)
            if kind == KV:
                pool[slot, :, :, :r].copy_(b[:, :, :r])
            else:
                pool[slot, :r].copy_(b[:r])

    def _owned(self, pool: torch.Tensor, kind: int, slot: int, rows: int) -> torch.Tensor:
        """A block's own copy for the memory tiers (pinned when CUDA is available)."""
        view = pool[slot, :, :, :rows] if kind == KV else pool[slot, :rows]
        out = torch.empty(view.shape, dtype=view.dtype, pin_memory=self._pin_host)
        return out.copy_(view)

    def _account(self, plan: _Plan, nbytes_disk: int) -> ReadStats:
        disk = plan.disk
        assert disk is not None
        kind, nbytes, shares = plan.kind, plan.nbytes, plan.shares
        label = "kv" if kind == KV else "probe"
        looked = [s for s in range(len(nbytes)) if plan.source.get(s) != "known"]
        stats = ReadStats(disk_bytes=nbytes_disk, disk_blocks=len(disk), memory_blocks=len(looked) - len(disk))
        if plan.quiet:
            return stats
        disk_sum = int(nbytes[disk].sum())
        with self._lock:
            c = self.counters
            c.bytes_read_disk += nbytes_disk
            c.blocks_read += len(disk)
            cell = c.served[label]["disk"]
            cell[0] += len(disk)
            cell[1] += disk_sum
            for s, src in plan.source.items():
                if src != "known":
                    c.served[label][src][0] += 1
                    c.served[label][src][1] += int(nbytes[s])
            if kind != KV:
                c.probe_bytes_read_disk += disk_sum
                return stats
            if plan.decode:
                c.decode_blocks += len(looked)
                c.decode_bytes_read_disk += disk_sum
                return stats
            important = shares * plan.rows
            c.important_rows_needed += float(important[looked].sum())
            for s, src in plan.source.items():
                if src == DEVICE:
                    c.important_rows_device += float(important[s])
                elif src == HOST:
                    c.important_rows_host += float(important[s])
            unattended = float((nbytes[disk] * (1.0 - shares[disk])).sum())
            c.kv_bytes_read_disk += disk_sum
            c.kv_bytes_unattended += unattended
            stats.kv_disk_bytes = disk_sum
            stats.kv_unattended_bytes = unattended
        return stats
