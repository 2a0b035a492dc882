"""ImpressStore: the persistent prefix KV store on disk, and the facade over its rooms.

The store knows nothing about ``generate``: `ImpressCache` asks it for the longest
stored prefix of a prompt (`match`), protects what it matched (`lease`), reads blocks
(`read_blocks`, `start_layout`, `load`) and hands it the K/V of new prompts (`put_async`).
Each job lives in its own module:

========================  =============================================================
`catalog`                 radix tree + SQLite index + open-file table, under one lock
`blocks`                  the read path (memory tiers, then one batch of disk reads)
`writer`                  the write path (chunk file, fsync, rename, index transaction)
`leases`                  match grace periods and lease references
`gc`                      quarantine, orphans, the disk budget
`persist`                 block statistics saved and reloaded
`reorder`                 row importance per node, and the reorganiser that rewrites nodes
`activity`                whether requests or writes are in progress (background work waits)
`binding`                 the model and probe settings a store is bound to
`namespaces`              the keys of prompts stored under a namespace
`tiering`                 the memory tiers built from the configuration
`report`                  `stats`
========================  =============================================================
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config import ImpressConfig
from ..errors import ConfigError, ImpressError, StoreFormatError
from ..index.radix import Match, RadixTree, Segment
from ..index.sqlite import FileRecord, Index
from ..storage import FORMATS
from ..storage.base import KV, BlockKey
from ..storage.reader import BlockReader
from ..tiers.policies import make_policy
from .activity import Activity
from .binding import bind, recorded
from .blocks import BlockIO, PendingRead
from .blockset import BlockSet
from .direct import RowsRead
from .catalog import CHUNK_DIR, Catalog
from .chunkfiles import check_match, check_tables
from .directory import prepare
from .gc import StoreGC, drop_blocks
from .layout import PrefixLayout
from .leftovers import remove_leftovers
from .leases import LeaseTable, PrefixLease
from .namespaces import Namespaces
from .persist import StatsKeeper
from .reorder import ImportanceStats
from .costs import CostModel
from .remote import NoRemote, RemoteTier
from .reorder.room import Reordering
from .values import NodeValues
from .report import build_stats
from .warmup import warmup
from .loading import LoadedPrefix, load_layout
from .states import StateCheckpoints
from .tiering import make_tiers, policy_kwargs
from .writer import PromptWriter

log = logging.getLogger(__name__)

INDEX_NAME = "index.sqlite"
#: what `put_async` returns in a read-only store (nothing to wait for)
_DONE: Future[None] = Future()
_DONE.set_result(None)
_MAX_INDEX_REPAIRS = 8




class ImpressStore:
    """A directory of chunk files plus a SQLite index, bound to one model.

    Parameters
    ----------
    path:
        Store directory; created if missing, reopened if it holds a store.
    model:
        The Hugging Face causal LM whose K/V the store keeps. Its architecture, KV
        shape, dtype and a weight fingerprint are recorded; reopening the store with
        a different model raises `ModelMismatchError`. ``None`` opens an existing
        store for maintenance (`reorganize`, `enforce_disk_budget`, `stats`) with the
        model settings it records; such a store cannot serve `ImpressCache` requests.
    config:
        `ImpressConfig`; defaults apply when omitted.
    storage_format:
        ``"safetensors"`` (default) or ``"hdf5"`` for chunk files written from now on.
        Files of both formats can live in one store.
    clock:
        Monotonic clock in seconds for everything time-dependent in the store: the
        memory tiers' policy (recency, score decay, statistics' ages) and the grace
        period of matches. ``time.monotonic`` by default; simulations and tests inject
        their own.
    read_only:
        Serve from a store on a read-only volume or directory: nothing is written (new
        prompts are not stored, block statistics stay in memory, a damaged file is only
        forgotten by this process). Opening a store the process cannot write without
        it raises `ReadOnlyStoreError` saying so.

    Notes
    -----
    The store is a context manager; `close` waits for pending writes and saves the
    block statistics of the memory tiers. Blocks (K/V and probe keys) are cached in two
    memory tiers (`tiers`, a `TierManager`) with the budgets ``config.device_bytes`` and
    ``config.host_bytes`` and the policy ``config.policy``; ``config.disk_bytes`` bounds
    the chunk files (`enforce_disk_budget`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: torch.nn.Module | None,
        config: ImpressConfig | None = None,
        storage_format: str = "safetensors",
        *,
        clock: Callable[[], float] | None = None,
        read_only: bool = False,
    ) -> None:
        self.config = config if config is not None else ImpressConfig()
        if not isinstance(self.config, ImpressConfig):
            raise TypeError(f"config must be an ImpressConfig, got {type(self.config).__name__}")
        if storage_format not in FORMATS:
            raise ValueError(f"storage_format must be one of {sorted(FORMATS)}, got {storage_format!r}")
        self.path = Path(path)
        self.model = model
        self.clock = clock if clock is not None else time.monotonic
        #: serve only: nothing is written (no prompts, statistics, quarantine or eviction on disk)
        self.read_only = bool(read_only)
        prepare(self.path, CHUNK_DIR, INDEX_NAME, self.config.file_mode, self.read_only)
        index = Index(self.path / INDEX_NAME, read_only=self.read_only, file_mode=self.config.file_mode)
        try:
            self.spec, self.probe = (
                recorded(index, self.path) if model is None else bind(index, model, self.config, self.path)
            )
            if storage_format == "hdf5" and self.spec.kv_dtype == "bfloat16":
                raise ConfigError("the hdf5 storage format cannot hold bfloat16; use safetensors or kv_dtype='float16'")
            row_bytes = (self.spec.kv_row_bytes, self.probe.record_bytes)
            self._values = NodeValues(make_policy(self.config.policy, **policy_kwargs(self.config)), self.clock)
            self._importance = ImportanceStats(self.spec.num_layers, self.config.half_life_s, self.clock)
            on_leaves = self._values.leaves_changed  # the disk budget's candidates
            self._catalog = Catalog(self.path, index, row_bytes, self._forget_files, self._split, on_leaves)
        except BaseException:
            index.close()
            raise
        cfg = self.config
        self._closed = False
        self.device = _model_device(model)
        self.tiers = make_tiers(cfg, self.device, self.clock)
        #: requests and writes in progress (background rewrites wait for idleness)
        self.activity = Activity()
        self._leases = LeaseTable(self.clock, self._catalog.unlink, activity=self.activity, indexed=self._catalog.indexed)
        self._reader = BlockReader(threads=cfg.io_threads)
        self._writer = PromptWriter(
            self._catalog, cfg, self.spec, self.probe, FORMATS[storage_format](fsync=cfg.fsync), self._written,
            self.activity,
        )
        self._stats = StatsKeeper(
            index, self.tiers, self._values, None if self.read_only else cfg.stats_interval_s, self._writer.background,
            self._importance, self._catalog.lock,
        )
        self._remote = NoRemote() if cfg.remote is None or model is None or self.read_only else RemoteTier(  # shared tier
            self._catalog, cfg, self.spec, self.probe, row_bytes, lambda f, b, leaf: self._written(f, b, leaf, False))
        #: measured costs that choose exact reuse or sparse loading (``important_ratio="auto"``)
        self.costs = CostModel.load(self.path, not self.read_only, cfg.file_mode)
        self._io = BlockIO(
            self._catalog, self.tiers, self.spec, self.probe.record_bytes, self._reader, self._stats.mark,
            pin_host=torch.cuda.is_available(), fill=self._remote.files, direct_io=cfg.direct_io,  # (fill: linked files)
        )
        self._gc = StoreGC(self._catalog, self._leases, self._values, self.clock, cfg.file_mode)
        self._reorder = Reordering(
            self.path, self._catalog, self._io, self._writer, self._leases, self._values, self.tiers,
            self.activity, self._importance, self.spec, cfg,
        )
        #: the keys of prompts stored under a namespace (`namespaces`)
        self.namespaces = Namespaces(index, self.spec.vocab_size, self.read_only)
        self.states = StateCheckpoints.of(self.path, self.spec, cfg, self.read_only, self._writer.submit_job)
        #: background reads that requests start and wait for later (e.g. the rest of a prefix)
        self.fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="impress-fetch")
        #: threads that read requests' prefixes layer by layer while the model computes
        self.loader = ThreadPoolExecutor(max_workers=4, thread_name_prefix="impress-load")
        loaded = self._stats.load()  # (the node statistics: the writer thread's first job)
        if not self.read_only:  # crash leftovers: on the writer thread, unless the index lists no file
            self._writer.start_scan(lambda: remove_leftovers(self._catalog, cfg.file_mode, self._leases.deferred_names), not len(self._catalog.records))
        if cfg.reorg_idle_ms is not None and model is not None and not self.read_only:
            self._reorder.reorganizer.start()
        log.info("opened store %s: %d nodes, %d files, statistics of %d blocks", self.path, len(self.tree), len(self._catalog.records), loaded)

    # -- the rooms' state, for inspection ----------------------------------------------
    @property
    def index(self) -> Index:
        """The SQLite index."""
        return self._catalog.index

    @property
    def tree(self) -> RadixTree:
        """The radix tree of stored prompts (mirrors the index)."""
        return self._catalog.tree

    # -- life cycle ------------------------------------------------------------------
    def __enter__(self) -> ImpressStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish pending writes, save block statistics and release files; every step
        runs even when one fails. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        steps = (
            self._reorder.reorganizer.stop, self._writer.flush, self._writer.close, self._leases.unlinker.close,
            lambda: self.fetcher.shutdown(wait=True), lambda: self.loader.shutdown(wait=True),
            self._remote.close,  # after the fetch threads: their reads may fill linked files
            self.save_block_stats, self.costs.save, lambda: setattr(self._stats, "closed", True), self._reader.close, self._catalog.close, self.index.close,
        )
        failure: BaseException | None = None
        for step in steps:
            try:
                step()
            except Exception as exc:  # release the rest, then report the first failure
                failure = failure or exc
        if failure is not None:
            raise failure

    def flush(self) -> None:
        """Wait until every prompt handed to `put_async` is written or dropped (a write the
        disk or index refused is counted in ``stats()["write_failures"]`` and logged, not
        raised), then save the statistics of the blocks read since the last save."""
        self._writer.flush()
        self._leases.unlinker.drain()
        self._remote.flush()  # write-through: uploaded (or dropped after remote_retry_s)
        self.save_block_stats()
        self.costs.save()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the store at {self.path} is closed")

    # -- lookups ---------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None, *, namespace: str | None = None) -> Match:
        """Longest prefix of ``tokens`` (at most ``limit`` tokens) stored under ``namespace``
        (`namespaces`). Its nodes are safe from disk eviction for `MATCH_GRACE_S` seconds of
        the store's clock (a `lease` keeps them longer). When a write still in flight would
        match more, that write is waited for (at most ``config.write_wait_s``; ``waited_s``)."""
        self._check_open()
        self.activity.touch()
        arr = self.namespaces.key(tokens, namespace)
        if arr is None:
            return Match(0, ())  # nothing was ever stored under this namespace
        waited = self._writer.inflight.wait_for(
            arr[:limit], lambda: self._catalog.match(arr, limit).length, self.config.write_wait_s)
        self._remote.pull(arr, limit)  # a prefix another host stored becomes local first
        for _ in range(_MAX_INDEX_REPAIRS):
            with self._catalog.lock:
                m = self._catalog.match(arr, limit)
                bad = check_match(self._catalog.records, arr, m)
                if bad is None:
                    self._leases.note(m)
            bad = bad or check_tables(self._catalog.open_file, m)  # (a file's record read as its header says)
            if bad is None:
                return replace(m, waited_s=waited) if waited else m
            self.quarantine(*bad)
        raise StoreFormatError(f"the index of {self.path} keeps contradicting its chunk files; run `impress-cache verify --repair`")

    def lease(self, matches: Iterable[Match], share: float | None = 1.0) -> PrefixLease:
        """Protect matched prefixes from disk eviction while a request uses them.

        Every chunk file of every match gets one reference; the disk budget never removes
        a prefix whose file is referenced. Leasing also records one access on every
        matched node (`access`), unless ``share`` is ``None`` (the request records it once
        it knows what it loads). Release the returned `PrefixLease` (or drop it) when the
        request holds what it needs; match again if it is ``stale``.
        """
        matches = list(matches)
        if share is not None:
            self.access(matches, share)
        return self._leases.lease(matches)

    def access(self, matches: Iterable[Match], share: float) -> None:
        """One access on every matched node, ``share`` the fraction of the prefix the
        request loads for its prefill (the nodes' value for the disk budget)."""
        self._values.access((seg.node.id for m in matches for seg in m.segments), share)

    def leased_files(self) -> dict[int, int]:
        """Chunk files leased by requests of this process: ``file_id -> references``."""
        return self._leases.held()

    def chunk_tokens_of(self, file_id: int) -> int:
        return self._catalog.chunk_tokens_of(file_id)

    def layout(self, segments: Sequence[Segment]) -> PrefixLayout:
        """Units (file blocks) holding a matched prefix; see `PrefixLayout`."""
        return PrefixLayout(segments, self._catalog.chunk_tokens_of, self._catalog.perm_of)

    # -- reads -----------------------------------------------------------------------
    def read_blocks(
        self, keys: Sequence[BlockKey], shares: Sequence[float | None] | None = None, *, decode: bool = False,
        known: Mapping[int, torch.Tensor] | None = None,
    ) -> BlockSet:
        """Read blocks ``(file_id, kind, layer, block)`` of one kind: memory tiers first,
        then one batch of disk reads (checksums verified). See `BlockIO.read`."""
        self._check_open()
        return self._io.read(keys, shares, decode=decode, known=known)

    def load(
        self,
        segments: Sequence[Segment],
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        known: Mapping[int, torch.Tensor] | None = None,
        decode: bool = False,
        layers: Sequence[int] | None = None,
    ) -> LoadedPrefix:
        """Read every K/V row of ``segments`` (a match, possibly cut shorter).

        Returns ``[layers, kv_heads, tokens, head_dim]`` tensors in the stored dtype,
        written into ``out`` (a pair of tensors, or views, of that shape) when given.
        Blocks in ``known`` (`block_code` -> block, already read by this request) are not
        read again; ``decode`` marks the reads as decode-only (see `read_blocks`).
        ``layers``: only these stored layers are read (the others' parts of ``out`` are
        left as they are; default: every layer). Raises `CorruptBlockError` when a block
        is missing or damaged; the caller quarantines the file (`quarantine`) and matches
        again.
        """
        return load_layout(self.spec, self.layout(segments), self.start_layout, out, known, decode, layers)

    def where(self, layout: PrefixLayout) -> tuple[float, bool]:
        """Share of a prefix's blocks in the memory tiers, and whether the remote tier
        may still have to deliver some (`BlockIO.where`)."""
        return self._io.where(layout)

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
        place_hits: bool = True, inline: bool = False,
    ) -> PendingRead:
        """Start reading the blocks of ``units`` of a prefix layout for ``layers`` (the disk
        reads run in the background, or here if ``inline``); see `BlockIO.start_layout`."""
        self._check_open()
        return self._io.start_layout(
            layout, kind, layers, units, shares, decode=decode, known=known, place_hits=place_hits, inline=inline
        )

    def start_rows(self, layout: PrefixLayout, layer: int, out: torch.Tensor) -> RowsRead | None:
        """Every row of ``layer`` read from disk straight into ``out``, or ``None``: `BlockIO.start_rows`."""
        self._check_open()
        return self._io.start_rows(layout, layer, out)

    def resident_rows(self, layout: PrefixLayout, layer: int) -> list[torch.Tensor] | None:
        """Every row of ``layer`` of a prefix as views of slabs held in the memory tiers,
        or ``None``; see `BlockIO.resident_rows`."""
        self._check_open()
        return self._io.resident_rows(layout, layer)

    # -- writes ----------------------------------------------------------------------
    def put_async(
        self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor], valid_from: int = 0, *,
        namespace: str | None = None,
    ) -> Future[None]:
        """Store a prompt's K/V under ``namespace`` in the background: ``keys[layer]``, ``values[layer]`` are
        ``[kv_heads, len(tokens), head_dim]`` per stored layer (any device, dtype); only tokens not stored yet
        are written. Rows before ``valid_from`` are not K/V (a window never held them): no write unless stored."""
        self._check_open()
        if self.read_only:
            return _DONE
        return self._writer.submit(self.namespaces.key(tokens, namespace, create=True), keys, values, valid_from)

    def put(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor], *, namespace: str | None = None) -> None:
        """`put_async` and wait for the write: on return the prompt is on disk and indexed,
        unless it was stored already or the write was refused (see `flush`)."""
        self.put_async(tokens, keys, values, namespace=namespace).result()

    def _written(self, file_id: int, blocks: int, leaf: Any, push: bool = True) -> None:
        # a new prefix has statistics from the start (LRU: written counts as used)
        if leaf is not None:
            self._values.seed(leaf.id)
        if self.tiers.enabled:
            for layer in range(self.spec.num_layers):
                for b in range(blocks):
                    self.tiers.seed((file_id, KV, layer, b), 1.0)
        if self.config.disk_bytes is not None:
            try:
                self._gc.enforce(self.config.disk_bytes, written=None if leaf is None else leaf.id)
                self._leases.unlinker.drain(report=False)  # what it evicted is gone when the write returns
            except Exception:
                log.exception("enforcing the disk budget failed; the store may stay over disk_bytes")
        self._remote.push(leaf if push else None)  # upload what this host wrote

    def _split(self, old_id: int, new_ids: tuple[int, ...], k: int) -> None:
        """A node's rows now live in ``new_ids`` (halves split at ``k``, or a rewrite): they inherit its statistics."""
        self._values.inherit(old_id, new_ids)
        self._importance.split(old_id, new_ids, k)

    def _forget_files(self, file_ids: set[int], records: dict[int, FileRecord]) -> None:
        """Drop everything the memory tiers know about blocks of deleted files."""
        drop_blocks(self.tiers, file_ids, records)

    # -- maintenance -----------------------------------------------------------------
    def quarantine(self, file_id: int, reason: str) -> bool:
        """Move a damaged chunk file to ``quarantine/`` and forget every prefix that needs
        it; later requests recompute those tokens. False: the file had left the index."""
        self._remote.quarantined(self._catalog.records.get(file_id))
        return self._gc.quarantine(file_id, reason)

    def enforce_disk_budget(self, protect: Iterable[int] = ()) -> dict[str, int]:
        """Remove the least valuable unused prefixes until the store fits ``disk_bytes``.

        Called automatically after each write that adds a chunk file; ``protect`` names
        node ids that must stay (the prefix just written). Returns ``removed_prefixes``,
        ``removed_files``, ``freed_bytes``, ``disk_bytes`` (after) and ``budget``. See
        `StoreGC.enforce`.
        """
        self._check_open()
        return self._gc.enforce(None if self.read_only else self.config.disk_bytes, protect)

    def record_importance(
        self, segments: Sequence[Segment], importance: Any, blocks_touched: int = 0, rows_selected: int = 0
    ) -> None:
        """What a sparse prefill learned: ``importance`` is ``[layers, positions]`` over
        its matched ``segments`` (per layer, 1 where a row ranked in the top ``k``;
        ``None`` when not known), with the blocks it touched for the rows it selected.
        Feeds the reorganiser (docs: Importance reordering)."""
        self._reorder.record(segments, importance, blocks_touched, rows_selected)

    def reorganize(self, force: bool = False, limit: int | None = None, progress: bool = False) -> dict[str, Any]:
        """Rewrite the nodes whose rows the statistics say to reorder, now (waiting, like
        the background rewrites, for idleness before every block).

        Without ``force`` a node needs ``config.reorg_min_requests`` sparse requests since
        its order was last decided and an expected gain of ``config.reorg_min_gain``;
        ``force`` rewrites every node with statistics whose order would pack its
        important rows into fewer blocks. Returns ``rewritten``, ``abandoned`` (nodes
        that changed meanwhile), ``bytes_rewritten``, ``seconds`` and ``busy`` (another
        process or thread was rewriting the store: nothing done)."""
        self._check_open()
        self._writer.flush()
        return self._reorder.run(force, limit, progress)

    def save_block_stats(self) -> int:
        """Write the statistics of the blocks accessed since the last save to the index
        (runs on `flush`, on `close` and every ``config.stats_interval_s`` seconds).
        Returns the number of block records written. A read-only store keeps them in
        memory; a failure (disk full) is logged and the statistics are kept for later.
        Requests match meanwhile: this holds the index, not the catalog's lock."""
        if self.read_only:
            return 0
        try:
            return self._stats.save()
        except (OSError, ImpressError) as exc:
            log.warning("saving block statistics to %s failed: %s", self.path, exc)
            return 0

    def warmup(self, prompts: Iterable[Any], tokenizer: Any = None) -> dict[str, int]:
        """Pre-populate block statistics and the memory tiers from known prompts; see
        `warmup.warmup`. Returns ``prompts`` (matched), ``matched_tokens``, ``blocks`` and
        ``bytes_read_disk``."""
        self._check_open()
        return warmup(self, prompts, tokenizer)

    # -- introspection ---------------------------------------------------------------
    def disk_bytes(self) -> int:
        """Bytes the store takes on disk, as the disk budget counts them (chunk files, index, WAL)."""
        return self._catalog.disk_bytes()

    def stats(self) -> dict[str, Any]:
        """Counters of this store since it was opened (or since `reset_stats`).

        Returns
        -------
        dict
            Writes: ``prompts_written``, ``tokens_written``, ``bytes_written``,
            ``write_seconds``, ``write_failures``, ``after_commit_failures`` (steps after a
            committed index transaction that failed: the commit stays, the tree is
            reloaded from the index); reads: ``bytes_read_disk`` (bytes really read from disk,
            K/V and probe blocks, including alignment gaps of merged reads),
            ``blocks_read`` (blocks read from disk); ``quarantined_files``, ``nodes``,
            ``files``, ``disk_bytes``.

            Block lookups, per kind: ``lookups["kv"]`` and ``lookups["probe"]`` each hold
            ``blocks`` and ``bytes`` looked up and, per source (``"device"``, ``"host"``,
            ``"disk"``), ``blocks``, ``bytes``, ``hit_ratio`` and ``byte_hit_ratio``
            (the three sources add up to 1). ``kv_blocks_accessed`` and
            ``kv_bytes_accessed`` repeat the K/V totals.

            Memory tiers: ``policy``; ``tiers`` (see `TierManager.stats`) plus
            ``bytes_moved_between_tiers``.

            Importance (prefill reads; decode-only reads excluded):
            ``important_rows_needed`` (sum over K/V block accesses of share x rows),
            ``important_rows_device`` / ``_host`` / ``_disk``, ``important_kv_hit_rate``
            (rows served by a memory tier / rows needed), ``important_kv_device_hit_rate``,
            ``important_kv_host_hit_rate``, ``invalid_io_ratio`` (see
            `invalid_io_ratio`), ``kv_bytes_read_disk``, ``decode_bytes_read_disk``,
            ``probe_bytes_read_disk`` (block sizes, without gaps).

            Disk budget: ``disk_budget`` (``None``: unbounded), ``prefixes_evicted``, ``files_evicted``, ``disk_bytes_evicted``.

            Reordering: ``reorganisations`` (nodes rewritten), ``bytes_rewritten``,
            ``reorg_bytes_read``, ``reorg_seconds``, ``reorgs_abandoned``;
            ``sparse_requests`` and ``blocks_per_selected_row`` (K/V blocks touched per
            selected row, over every layer of those requests; ``1 / chunk_tokens`` is
            the least possible).

            ``log_applied``: other processes' commits followed through the index's change
            log; ``log_reloads``: whole-tree reloads instead (the log was trimmed past the
            tree's position, or the store has none: opened read-only before a newer
            version migrated it).

            ``remote``: the remote tier's counters (`RemoteCounters`), ``None`` without one;
            ``saved_rows_skipped``: saved statistics skipped as impossible, per kind.
            ``state_checkpoints``, ``state_bytes``: a hybrid model's state checkpoints.
        """
        out = build_stats(
            self._writer.counters, self._io.counters, self._gc.counters, self.tiers.stats(), self.tiers.policy.name,
            len(self.tree), len(self._catalog.records), self.disk_bytes(), self.config.disk_bytes,
        )
        cat = self._catalog
        out.update(self._reorder.stats(), after_commit_failures=cat.after_commit_failures)
        out.update(log_applied=cat.log_applied, log_reloads=cat.log_reloads)
        out.update(remote=self._remote.stats(), saved_rows_skipped=dict(self._stats.skipped))
        out["state_checkpoints"], out["state_bytes"] = StateCheckpoints.usage_of(self.states)
        return out

    def reset_stats(self) -> None:
        """Zero the counters of `stats` (tier residency and block statistics stay)."""
        self._writer.counters = type(self._writer.counters)()
        self._gc.counters = type(self._gc.counters)()
        self._catalog.after_commit_failures = 0
        self._catalog.log_applied = self._catalog.log_reloads = 0
        self._io.reset()
        self._reorder.reset_stats()
        self.tiers.reset_stats()


def _model_device(model: torch.nn.Module | None) -> torch.device:
    if model is None:
        return torch.device("cpu")
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")
