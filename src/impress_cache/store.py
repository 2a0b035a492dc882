"""ImpressStore: the persistent prefix KV store on disk.

It ties together the SQLite index (`index`), the radix tree
(`radix`), the chunk-file formats (`storage`) and the memory
tiers (`tiers`). It knows nothing about ``generate``:
`ImpressCache` asks it for the longest stored prefix of a prompt, for
those rows' K/V, and hands it the K/V of new prompts to keep.

Every block read goes through `ImpressStore.read_blocks`: the device tier, then the
host tier, then the disk (see ``docs/tiers.md``). K/V blocks and probe-key blocks are
both cached; a probe block always counts as fully important (every row is used).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import ImpressConfig
from .errors import ConfigError, CorruptBlockError
from .index import FileRecord, Index
from .model_info import ModelSpec, model_spec
from . import probe as probe_codec
from .importance import choose_probe_heads
from .layout import PrefixLayout, on_cpu
from .policies import make_policy
from .radix import Match, RadixNode, RadixTree, Segment
from .storage import FORMATS, BlockInfo, BlockReader, ReadRequest, iter_blocks
from .storage.base import KV, PROBE, BlockData, crc32, fsync_path, tensor_bytes
from .tiers import DEVICE, HOST, TierManager

log = logging.getLogger(__name__)

INDEX_NAME = "index.sqlite"
CHUNK_DIR = "chunks"
QUARANTINE_DIR = "quarantine"
#: seconds after a match during which disk eviction leaves the matched nodes alone
#: (covers the moment between `ImpressStore.match` and `ImpressStore.lease`)
MATCH_GRACE_S = 5.0


@dataclass
class _OpenFile:
    record: FileRecord
    path: Path
    blocks: dict[tuple[int, int, int], BlockInfo]  # (kind, layer, block)


#: ``(file_id, kind, layer, block)``: the unit of disk I/O and of the memory tiers
BlockKey = tuple[int, int, int, int]


@dataclass(frozen=True)
class ProbeSpec:
    """Which KV heads the probe copy holds, and how it is encoded (fixed per store)."""

    query_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    encoding: str
    head_dim: int

    @property
    def record_bytes(self) -> int:
        return probe_codec.record_bytes(len(self.kv_heads), self.head_dim, self.encoding)


@dataclass
class StoreCounters:
    """Totals since the store was opened (or since `reset_stats`)."""

    prompts_written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    bytes_read_disk: int = 0
    blocks_read: int = 0
    quarantined_files: int = 0
    write_seconds: float = 0.0


#: where a block lookup was served from
SOURCES = (DEVICE, HOST, "disk")


def _zero_sources() -> dict[str, dict[str, list[int]]]:
    return {kind: {src: [0, 0] for src in SOURCES} for kind in ("kv", "probe")}


@dataclass
class TierCounters:
    """Importance-aware I/O counters of `ImpressStore.read_blocks` (see `ImpressStore.stats`)."""

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
    prefixes_evicted: int = 0
    files_evicted: int = 0
    disk_bytes_evicted: int = 0


class PrefixLease:
    """Protects the radix nodes of matched prefixes from disk eviction until released.

    Returned by `ImpressStore.lease`. `release` (or garbage collection of the lease)
    drops the references; calling it twice is harmless.
    """

    def __init__(self, store: ImpressStore, node_ids: Sequence[int]) -> None:
        #: ids of the nodes whose ``lock_ref`` this lease holds (one reference each)
        self.node_ids = tuple(node_ids)
        self._finalizer = weakref.finalize(self, _release_nodes, weakref.ref(store), self.node_ids)

    @property
    def active(self) -> bool:
        """Whether the lease still holds its references."""
        return self._finalizer.alive

    def release(self) -> None:
        """Drop the references (idempotent)."""
        self._finalizer()

    def __enter__(self) -> PrefixLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _release_nodes(store_ref: Callable[[], ImpressStore | None], node_ids: tuple[int, ...]) -> None:
    store = store_ref()
    if store is not None:
        store._unlock_nodes(node_ids)


@dataclass
class LoadedPrefix:
    """K/V rows of one matched prefix: ``keys[layer]`` is ``[kv_heads, tokens, head_dim]``."""

    keys: torch.Tensor
    values: torch.Tensor
    bytes_read: int
    blocks_read: int
    seconds: float
    layers: list[int] = field(default_factory=list)


class ImpressStore:
    """A directory of chunk files plus a SQLite index, bound to one model.

    Parameters
    ----------
    path:
        Store directory; created if missing, reopened if it holds a store.
    model:
        The Hugging Face causal LM whose K/V the store keeps. Its architecture, KV
        shape, dtype and a weight fingerprint are recorded; reopening the store with
        a different model raises `ModelMismatchError`.
    config:
        `ImpressConfig`; defaults apply when omitted.
    storage_format:
        ``"safetensors"`` (default) or ``"hdf5"`` for chunk files written from now on.
        Files of both formats can live in one store.
    clock:
        Monotonic clock in seconds used by the memory tiers' policy (recency, score
        decay, statistics' ages). ``time.monotonic`` by default; simulations and tests
        inject their own.

    Notes
    -----
    The store is a context manager; `close` waits for pending writes and saves the
    block statistics of the memory tiers.

    Blocks (K/V and probe keys) are cached in two memory tiers (`tiers`, a
    `TierManager`) with the budgets ``config.device_bytes`` and ``config.host_bytes``
    and the policy ``config.policy``; see `read_blocks`. ``config.disk_bytes`` bounds
    the chunk files (`enforce_disk_budget`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        config: ImpressConfig | None = None,
        storage_format: str = "safetensors",
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config if config is not None else ImpressConfig()
        if not isinstance(self.config, ImpressConfig):
            raise TypeError(f"config must be an ImpressConfig, got {type(self.config).__name__}")
        if storage_format not in FORMATS:
            raise ValueError(f"storage_format must be one of {sorted(FORMATS)}, got {storage_format!r}")
        self.path = Path(path)
        self.model = model
        self.spec: ModelSpec = model_spec(model, self.config.kv_dtype)
        if storage_format == "hdf5" and self.spec.kv_dtype == "bfloat16":
            raise ConfigError("the hdf5 storage format cannot hold bfloat16; use safetensors or kv_dtype='float16'")
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / CHUNK_DIR).mkdir(exist_ok=True)
        self._lock = threading.RLock()
        self.index = Index(self.path / INDEX_NAME)
        stored = self.index.get_json("model")
        if stored is None:
            self.index.set_meta("model", json.dumps(self.spec.to_dict()))
        else:
            self.spec.check_same(stored, str(self.path))
        self.probe = self._probe_spec()
        self._format_name = storage_format
        self._formats = {cls.suffix: cls(fsync=self.config.fsync) for cls in FORMATS.values()}
        self._reader = BlockReader(threads=self.config.io_threads)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="impress-write")
        #: background reads that requests start and wait for later (e.g. the rest of a prefix)
        self.fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="impress-fetch")
        self._pending: list[Future[None]] = []
        self._files: dict[int, _OpenFile] = {}
        #: name of every file whose blocks the memory tiers may hold (detects reused ids)
        self._known_files: dict[int, str] = {}
        self.counters = StoreCounters()
        self.tier_counters = TierCounters()
        self._closed = False
        self.tiers = self._make_tiers(clock)
        self._dirty: set[BlockKey] = set()
        self._stats_saved_at = self.tiers.now()
        self._matched_at: dict[int, float] = {}
        self.tree: RadixTree = self.index.load_tree()
        self._remove_orphans()
        loaded = self._load_block_stats()
        log.info(
            "opened store %s: %d nodes, %d files, statistics of %d blocks",
            self.path, len(self.tree), len(self.index.files()), loaded,
        )

    def _make_tiers(self, clock: Callable[[], float] | None) -> TierManager:
        cfg = self.config
        kwargs: dict[str, Any] = {}
        if cfg.policy.lower() == "score":
            kwargs["half_life_s"] = cfg.half_life_s
            kwargs["unimportant_weight"] = cfg.unimportant_weight
        policy = make_policy(cfg.policy, **kwargs)
        try:
            device = next(self.model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
        self.device = device
        pin = torch.cuda.is_available()
        self._pin_host = pin

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=pin)

        def to_host(t: torch.Tensor) -> torch.Tensor:
            host = t.to("cpu")
            return host.pin_memory() if pin and not host.is_pinned() else host

        return TierManager(
            cfg.device_bytes,
            cfg.host_bytes,
            policy,
            class_shares=cfg.tier_shares,
            clock=clock if clock is not None else time.monotonic,
            to_device=to_device,
            to_host=to_host,
            disk_to_device=True,
        )

    def _probe_spec(self) -> ProbeSpec:
        spec, cfg = self.spec, self.config
        q = choose_probe_heads(spec.num_attention_heads, spec.num_kv_heads, min(cfg.probe_heads, spec.num_attention_heads))
        group = spec.num_attention_heads // spec.num_kv_heads
        kv = tuple(sorted({h // group for h in q}))
        want = {"query_heads": list(q), "kv_heads": list(kv), "encoding": cfg.probe_dtype}
        stored = self.index.get_json("probe")
        if stored is None:
            self.index.set_meta("probe", json.dumps(want))
        elif stored != want:
            diffs = [f"{k}: store has {stored.get(k)!r}, config gives {want[k]!r}" for k in want if stored.get(k) != want[k]]
            raise ConfigError(
                f"the store at {self.path} keeps probe keys for other settings ({'; '.join(diffs)}); "
                "use the probe_heads / probe_dtype it was created with"
            )
        return ProbeSpec(tuple(q), kv, cfg.probe_dtype, spec.head_dim)

    # -- life cycle ------------------------------------------------------------------
    def __enter__(self) -> ImpressStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish pending writes, save block statistics and release files. Safe to call twice."""
        if self._closed:
            return
        self.flush()
        self._writer.shutdown(wait=True)
        self.fetcher.shutdown(wait=True)
        self.save_block_stats()
        self._reader.close()
        self.index.close()
        self._closed = True

    def flush(self) -> None:
        """Block until every prompt handed to `put_async` is on disk and indexed.

        Also saves the statistics of the blocks read since the last save (see
        `save_block_stats`).
        """
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                break
            for fut in pending:
                fut.result()
        self.save_block_stats()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the store at {self.path} is closed")

    # -- lookups ---------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """Longest stored prefix of ``tokens`` (at most ``limit`` tokens).

        The matched nodes are safe from disk eviction for `MATCH_GRACE_S` seconds;
        take a `lease` to keep them for longer.
        """
        self._check_open()
        with self._lock:
            self._refresh()
            m = self.tree.match(tokens, limit)
            now = time.monotonic()
            if len(self._matched_at) > 4 * len(self.tree) + 1024:
                self._matched_at = {k: t for k, t in self._matched_at.items() if now - t < MATCH_GRACE_S}
            for seg in m.segments:
                self._matched_at[seg.node.id] = now
            return m

    def lease(self, matches: Iterable[Match]) -> PrefixLease:
        """Protect matched prefixes from disk eviction while a request uses them.

        Every node of every match gets one reference (``lock_ref``); nodes with
        references are never removed by the disk budget. `ImpressCache` holds a lease
        until it has read everything it needs (the constructor for dense reuse, the
        prefill or the background read of the rest of the prefix for sparse reuse).

        Parameters
        ----------
        matches:
            Results of `match`.

        Returns
        -------
        PrefixLease
            Release it (or drop it) when the request is done.
        """
        ids: list[int] = []
        with self._lock:
            for m in matches:
                for seg in m.segments:
                    try:
                        node = self.tree.node(seg.node.id)
                    except KeyError:
                        continue  # removed meanwhile; nothing to protect
                    node.lock_ref += 1
                    ids.append(node.id)
        return PrefixLease(self, ids)

    def _unlock_nodes(self, node_ids: Iterable[int]) -> None:
        with self._lock:
            for node_id in node_ids:
                try:
                    node = self.tree.node(node_id)
                except KeyError:
                    continue
                node.lock_ref = max(0, node.lock_ref - 1)

    def chunk_tokens_of(self, file_id: int) -> int:
        return self._open_file(file_id).record.chunk_tokens

    def layout(self, segments: Sequence[Segment]) -> PrefixLayout:
        """Units (file blocks) holding a matched prefix; see `PrefixLayout`."""
        return PrefixLayout(segments, self.chunk_tokens_of)

    def read_blocks(
        self,
        keys: Sequence[BlockKey],
        shares: Sequence[float | None] | None = None,
        *,
        decode: bool = False,
    ) -> tuple[list[memoryview | torch.Tensor], int]:
        """Read blocks ``(file_id, kind, layer, block)``: memory tiers first, then disk.

        Each distinct block is looked up in the device tier, then in the host tier; the
        misses are read from disk with coalesced ``preadv`` (checksums verified) and
        offered to the tiers (`TierManager.put_from_disk`). Each distinct block counts
        one access (`TierManager.touch`) with its importance share, and all of them
        are pinned in memory while the call runs. K/V blocks (kind ``KV``) and
        probe-key blocks (kind ``PROBE``) are cached alike.

        Parameters
        ----------
        keys:
            Blocks to read; duplicates are read (and counted) once.
        shares:
            Per key, the fraction of the block's rows the request attends to (its
            importance share, in ``[0, 1]``); ``None`` (for all or one key) means all
            rows. Probe blocks are always fully used (1.0).
        decode:
            The K/V blocks are read only to decode after a sparse prefill that did not
            select them: their accesses are recorded with share 0 and they are
            excluded from the importance metrics (important-KV hit rate, invalid I/O).

        Returns
        -------
        list of memoryview or torch.Tensor, int
            Each block (in ``keys`` order) and the bytes really read from disk (0 when
            every block was in memory). Blocks come as tensors (the tier's copy on a
            hit: do not modify it) or, when both memory budgets are 0, as the
            verified bytes. Pass K/V blocks to `kv_block`.

        Raises
        ------
        CorruptBlockError
            Naming the file of a missing or damaged block.
        """
        self._check_open()
        keys = list(keys)
        if shares is not None and len(shares) != len(keys):
            raise ValueError(f"shares must have one entry per key: {len(shares)} shares for {len(keys)} keys")
        infos = [self._block_info(key) for key in keys]
        out: list[memoryview | torch.Tensor | None] = [None] * len(keys)
        first: dict[BlockKey, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        tiers = self.tiers
        cache = self.config.device_bytes > 0 or self.config.host_bytes > 0
        share_of = {i: self._share(shares, i, decode and keys[i][1] == KV, keys[i][1]) for i in sorted(first.values())}
        served: dict[int, str] = {}
        disk: list[int] = []
        pinned: list[BlockKey] = []
        nbytes = 0
        try:
            for i in share_of:
                tiers.pin(keys[i])
                pinned.append(keys[i])
            for i, share in share_of.items():
                key = keys[i]
                tiers.touch(key, share)
                # the tier it is found in (a host hit may be promoted by get); the block
                # is pinned, so it cannot leave memory in between
                found = tiers.tier_of(key)
                hit = tiers.get(key, infos[i][1].nbytes)
                if hit is None:
                    disk.append(i)
                else:
                    served[i] = found or hit[0]
                    out[i] = hit[1]
            requests = [
                ReadRequest(keys[i][0], infos[i][0], infos[i][1].offset, infos[i][1].nbytes, infos[i][1].crc32)
                for i in disk
            ]
            views, nbytes = self._reader.read(requests) if requests else ([], 0)
            for i, view in zip(disk, views):
                if not cache:
                    out[i] = view
                    continue
                payload = self._host_copy(view, keys[i][1])
                tiers.put_from_disk(keys[i], payload, payload.numel() * payload.element_size(), share_of[i])
                out[i] = payload
        finally:
            for key in pinned:
                tiers.unpin(key)
        for i, key in enumerate(keys):
            if out[i] is None:
                out[i] = out[first[key]]
        self._account(keys, infos, share_of, served, disk, nbytes, decode)
        self._maybe_save_stats()
        return out, nbytes  # type: ignore[return-value]

    @staticmethod
    def _share(shares: Sequence[float | None] | None, i: int, decode: bool, kind: int) -> float:
        if decode:
            return 0.0
        if kind != KV or shares is None or shares[i] is None:
            return 1.0
        share = float(shares[i])  # type: ignore[arg-type]
        return 1.0 if math.isnan(share) else min(1.0, max(0.0, share))

    def _block_info(self, key: BlockKey) -> tuple[Path, BlockInfo]:
        file_id, kind, layer, block = key
        f = self._open_file(file_id)
        info = f.blocks.get((kind, layer, block))
        if info is None:
            raise CorruptBlockError(f"block {kind}/{layer}/{block} of file {f.path} is not indexed", file_id)
        return f.path, info

    def _host_copy(self, view: memoryview, kind: int) -> torch.Tensor:
        """A block's bytes as an owned tensor (K/V dtype for K/V blocks; pinned with CUDA)."""
        src = torch.frombuffer(view, dtype=torch.uint8)
        dst = torch.empty(src.shape, dtype=torch.uint8, pin_memory=self._pin_host)
        dst.copy_(src)
        return dst.view(self.spec.torch_kv_dtype) if kind == KV else dst

    def _account(
        self,
        keys: list[BlockKey],
        infos: list[tuple[Path, BlockInfo]],
        share_of: dict[int, float],
        served: dict[int, str],
        disk: list[int],
        nbytes: int,
        decode: bool,
    ) -> None:
        with self._lock:
            c, t = self.counters, self.tier_counters
            c.bytes_read_disk += nbytes
            c.blocks_read += len(disk)
            for i, share in share_of.items():
                info = infos[i][1]
                is_kv = keys[i][1] == KV
                source = served.get(i, "disk")
                cell = t.served["kv" if is_kv else "probe"][source]
                cell[0] += 1
                cell[1] += info.nbytes
                self._dirty.add(keys[i])
                if not is_kv:
                    if source == "disk":
                        t.probe_bytes_read_disk += info.nbytes
                    continue
                if decode:
                    t.decode_blocks += 1
                    if source == "disk":
                        t.decode_bytes_read_disk += info.nbytes
                    continue
                important = share * info.rows
                t.important_rows_needed += important
                if source == DEVICE:
                    t.important_rows_device += important
                elif source == HOST:
                    t.important_rows_host += important
                else:
                    t.kv_bytes_read_disk += info.nbytes
                    t.kv_bytes_unattended += info.nbytes * (1.0 - share)

    def kv_block(self, block: memoryview | torch.Tensor) -> torch.Tensor:
        """View a K/V block (bytes or tensor from `read_blocks`) as ``[2, kv_heads, rows, head_dim]``."""
        spec = self.spec
        if isinstance(block, torch.Tensor):
            t = block if block.dtype == spec.torch_kv_dtype else block.view(torch.uint8).view(spec.torch_kv_dtype)
        else:
            t = torch.frombuffer(block, dtype=spec.torch_kv_dtype)
        return t.view(2, spec.num_kv_heads, -1, spec.head_dim)

    def load(
        self,
        segments: Sequence[Segment],
        layers: Sequence[int] | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        memo: dict[BlockKey, memoryview | torch.Tensor] | None = None,
        decode: bool | None = None,
    ) -> LoadedPrefix:
        """Read every K/V row of ``segments`` (a match, possibly cut shorter).

        Returns ``[layers, kv_heads, tokens, head_dim]`` tensors in the stored dtype,
        written into ``out`` (a pair of tensors, or views, of that shape) when given.
        Blocks found in ``memo`` (already read by this request) are not read again.
        ``decode`` marks the reads as decode-only (see `read_blocks`); by default it is
        true exactly when a ``memo`` is given, i.e. when the request already read its
        important blocks during a sparse prefill and now fetches the rest.
        Raises `CorruptBlockError` when a block is missing or damaged; the
        caller quarantines the file (`quarantine`) and matches again.
        """
        t0 = time.perf_counter()
        spec = self.spec
        layers = list(range(spec.num_layers)) if layers is None else list(layers)
        lay = self.layout(segments)
        shape = (len(layers), spec.num_kv_heads, lay.length, spec.head_dim)
        if out is None:
            keys = torch.empty(shape, dtype=spec.torch_kv_dtype)
            values = torch.empty(shape, dtype=spec.torch_kv_dtype)
        else:
            keys, values = out
            if tuple(keys.shape) != shape or tuple(values.shape) != shape:
                raise ValueError(f"out tensors must have shape {shape}, got {tuple(keys.shape)}")
        wanted = [(li, u) for li in range(len(layers)) for u in lay.units]
        keys_of = [(u.file_id, KV, layers[li], u.block) for li, u in wanted]
        if decode is None:
            decode = memo is not None
        memo = {} if memo is None else memo
        missing = sorted({key for key in keys_of if key not in memo})
        views, nbytes = self.read_blocks(missing, decode=decode)
        memo.update(zip(missing, views))
        n_units = len(lay.units)
        for li in range(len(layers)):
            blocks = [self.kv_block(memo[key]) for key in keys_of[li * n_units : (li + 1) * n_units]]
            k, v = lay.gather(range(n_units), blocks)
            keys[li].copy_(k)
            values[li].copy_(v)
        return LoadedPrefix(keys, values, nbytes, len(missing), time.perf_counter() - t0, layers)

    def load_probes(self, layout: PrefixLayout, layers: Sequence[int] | None = None) -> tuple[list[torch.Tensor], int]:
        """Probe-key records of a prefix: per layer ``uint8 [tokens, record_bytes]``."""
        layers = list(range(self.spec.num_layers)) if layers is None else list(layers)
        rec = self.probe.record_bytes
        out = [torch.empty((layout.length, rec), dtype=torch.uint8) for _ in layers]
        n_units = len(layout.units)
        views, nbytes = self.read_blocks([(u.file_id, PROBE, layer, u.block) for layer in layers for u in layout.units])
        for li in range(len(layers)):
            blocks = on_cpu([
                (v if isinstance(v, torch.Tensor) else torch.frombuffer(v, dtype=torch.uint8)).view(-1, rec)
                for v in views[li * n_units : (li + 1) * n_units]
            ])
            idx = layout.row_index(range(n_units), [b.shape[0] for b in blocks])
            torch.index_select(torch.cat(blocks) if n_units > 1 else blocks[0], 0, idx, out=out[li])
        return out, nbytes

    def _open_file(self, file_id: int) -> _OpenFile:
        with self._lock:
            f = self._files.get(file_id)
            if f is None:
                record = self.index.file(file_id)
                if record is None:
                    raise CorruptBlockError(f"file {file_id} is not in the index", file_id)
                f = _OpenFile(record, self.path / CHUNK_DIR / record.name, self.index.blocks(file_id))
                self._files[file_id] = f
                known = self._known_files.get(file_id)
                if known is not None and known != record.name:
                    # the id was reused for a new file: blocks cached for the old one are stale
                    self._forget_files({file_id})
                self._known_files[file_id] = record.name
            return f

    # -- writes ----------------------------------------------------------------------
    def put_async(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> Future[None]:
        """Store a prompt's K/V in the background.

        ``keys[layer]`` and ``values[layer]`` are ``[kv_heads, len(tokens), head_dim]``
        (any device and dtype; they are converted in the writer thread). Only the
        tokens not already stored are written.
        """
        self._check_open()
        tokens = tuple(int(t) for t in tokens)
        _check_kv(self.spec, tokens, keys, values)
        fut = self._writer.submit(self._put, tokens, keys, values)
        with self._lock:
            # finished writes are dropped unless they failed: flush() re-raises those
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None] + [fut]
        return fut

    def put(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store a prompt's K/V and wait until it is on disk and indexed."""
        self.put_async(tokens, keys, values).result()

    def _put(self, tokens: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        try:
            self._put_inner(tokens, keys, values)
        except Exception:
            log.exception("storing a prompt of %d tokens failed; the store is unchanged", len(tokens))
            raise

    def _put_inner(self, tokens: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        with self._lock:
            self._refresh()
            m = self.tree.match(tokens).length
        if m == len(tokens):
            with self._lock, self.index.transaction() as conn:
                self._refresh_locked()
                _, upper, _ = self.tree.insert(tokens, file_id=-1)
                self._persist_insert(conn, upper, None, tokens)
            return
        dtype = self.spec.torch_kv_dtype
        ks = [k[:, m:].to("cpu", dtype) for k in keys]
        vs = [v[:, m:].to("cpu", dtype) for v in values]
        ct = self.config.chunk_tokens
        blocks = list(iter_blocks(ks, vs, ct))
        # each layer's probe copy is one contiguous tensor (no per-block alignment gaps),
        # indexed below in chunk_tokens pieces so that each piece has its own checksum
        probes = [probe_codec.encode(k[list(self.probe.kv_heads)], self.probe.encoding) for k in ks]
        for layer, raw in enumerate(probes):
            blocks.append(BlockData(PROBE, layer, -1, raw.shape[0], torch.uint8, tuple(raw.shape), tensor_bytes(raw)))
        fmt = self._formats[FORMATS[self._format_name].suffix]
        name = f"{uuid.uuid4().hex}.{fmt.suffix}"
        final = self.path / CHUNK_DIR / name
        tmp = final.with_name(name + ".tmp")
        meta = {"tokens_from": str(m), "n_tokens": str(len(tokens) - m), "chunk_tokens": str(self.config.chunk_tokens)}
        infos = _split_probe_infos(fmt.write(tmp, blocks, meta), probes, ct)
        os.replace(tmp, final)
        if self.config.fsync:
            fsync_path(final.parent)
        with self._lock, self.index.transaction() as conn:
            self._refresh_locked()
            m2 = self.tree.match(tokens).length
            if m2 < m:
                # part of the prefix we matched was deleted meanwhile: our file lacks those rows
                log.warning("prefix changed while writing; dropping a %d-token write", len(tokens) - m)
                final.unlink(missing_ok=True)
                return
            if m2 == len(tokens):
                final.unlink(missing_ok=True)
                _, upper, _ = self.tree.insert(tokens, file_id=-1)
                self._persist_insert(conn, upper, None, tokens)
                return
            file_id = self.index.add_file(conn, name, fmt.suffix, len(tokens) - m, self.config.chunk_tokens, infos)
            try:
                _, upper, leaf = self.tree.insert(tokens, file_id, file_row_of_first_new=m2 - m)
                self._persist_insert(conn, upper, leaf, tokens)
            except BaseException:
                self._reload_tree_locked()
                raise
        # a new block has statistics from the start (LRU: written counts as used)
        for info in infos:
            if info.kind == KV:
                self.tiers.seed((file_id, KV, info.layer, info.block), 1.0)
        self.counters.prompts_written += 1
        self.counters.tokens_written += len(tokens) - m
        self.counters.bytes_written += sum(i.nbytes for i in infos)
        self.counters.write_seconds += time.perf_counter() - t0
        if self.config.disk_bytes is not None:
            try:
                self.enforce_disk_budget(protect=() if leaf is None else (leaf.id,))
            except Exception:
                log.exception("enforcing the disk budget failed; the store may stay over disk_bytes")

    def _persist_insert(self, conn: Any, upper: Any, leaf: Any, tokens: tuple[int, ...]) -> None:
        if upper is not None:
            self.index.put_node(conn, upper)
            for child in upper.children.values():
                self.index.put_node(conn, child)
        if leaf is not None:
            self.index.put_node(conn, leaf)
        else:
            end = self.tree.match(tokens).segments
            if end:
                self.index.put_node(conn, end[-1].node)

    # -- consistency -----------------------------------------------------------------
    def _refresh(self) -> None:
        with self._lock:
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        """Reload the tree if another process changed the index."""
        if self.index.changed_elsewhere():
            self._reload_tree_locked()
            self._files.clear()
            current = {f.id: f.name for f in self.index.files()}
            stale = {fid for fid, name in self._known_files.items() if current.get(fid) != name}
            if stale:
                self._forget_files(stale)

    def _reload_tree_locked(self) -> None:
        """Rebuild the tree from the index, keeping the references of nodes still there."""
        locks = {n.id: n.lock_ref for n in self.tree.nodes() if n.lock_ref}
        self.tree = self.index.load_tree()
        for node_id, ref in locks.items():
            try:
                self.tree.node(node_id).lock_ref = ref
            except KeyError:
                pass

    def _forget_files(self, file_ids: set[int]) -> None:
        """Drop everything the memory tiers know about blocks of deleted files."""
        if not file_ids:
            return
        with self._lock:
            self.tiers.drop_where(lambda key: key[0] in file_ids)
            self._dirty = {k for k in self._dirty if k[0] not in file_ids}
            for fid in file_ids:
                self._known_files.pop(fid, None)
                self._files.pop(fid, None)

    def quarantine(self, file_id: int, reason: str) -> None:
        """Move a damaged chunk file aside and forget every prefix that needs it.

        Nodes stored in the file, and everything below them in the tree, are removed
        from the index; later requests recompute those tokens.
        """
        with self._lock, self.index.transaction() as conn:
            self._refresh_locked()
            doomed = [n for n in self.tree.nodes() if n.file_id == file_id]
            removed = 0
            for top in doomed:
                if top.parent is None:
                    continue  # already removed as part of another subtree
                for node in self.tree.subtree(top):
                    node.lock_ref = 0
                    self.tree.remove(node)
                    self.index.delete_node(conn, node.id)
                    removed += 1
            record = self.index.file(file_id)
            dropped = self._drop_unreferenced_files(conn)
            for rec in dropped:
                if rec.id != file_id:
                    (self.path / CHUNK_DIR / rec.name).unlink(missing_ok=True)
            self._forget_files({rec.id for rec in dropped} | {file_id})
            if record is not None:
                qdir = self.path / QUARANTINE_DIR
                qdir.mkdir(exist_ok=True)
                src = self.path / CHUNK_DIR / record.name
                if src.exists():
                    os.replace(src, qdir / record.name)
            self.counters.quarantined_files += 1
        log.warning(
            "quarantined chunk file %s (%s); removed %d node(s) that depended on it",
            record.name if record else file_id, reason, removed,
        )

    def _drop_unreferenced_files(self, conn: Any) -> list[FileRecord]:
        """Delete from the index the files no node references; return their records.

        The caller unlinks them once the transaction has committed (or, for a
        quarantined file, moves it aside).
        """
        dropped = []
        for fid in self.index.unreferenced_files(conn):
            rec = self.index.file(fid)
            self.index.delete_file(conn, fid)
            if rec is not None:
                dropped.append(rec)
        return dropped

    def _remove_orphans(self) -> None:
        """Delete temp files and chunk files the index does not know (crash leftovers)."""
        known = {f.name for f in self.index.files()}
        for p in (self.path / CHUNK_DIR).iterdir():
            if p.name not in known:
                log.info("removing unindexed file %s (left by an interrupted write)", p.name)
                p.unlink(missing_ok=True)

    # -- disk budget -----------------------------------------------------------------
    def enforce_disk_budget(self, protect: Iterable[int] = ()) -> dict[str, int]:
        """Remove the least valuable stored prefixes until the store fits ``disk_bytes``.

        Called automatically after each write that adds a chunk file. Candidates are
        the radix-tree leaves (whole stored prefixes, or their unshared tails) that are
        not in use: no `lease` reference, not matched in the last `MATCH_GRACE_S`
        seconds, no block pinned in memory, and not in ``protect``. The value of a
        leaf is the mean policy priority (`tiers.priority`: IMPRESS score, recency
        or access count) of its K/V blocks; the lowest goes first. All removals happen
        in one index transaction; then chunk files no node references any more are
        deleted. A file shared with nodes that stay is kept (its bytes are freed once
        its last node goes).

        Parameters
        ----------
        protect:
            Node ids that must stay (the prefix just written).

        Returns
        -------
        dict
            ``removed_prefixes``, ``removed_files``, ``freed_bytes``,
            ``disk_bytes`` (after) and ``budget``.
        """
        self._check_open()
        budget = self.config.disk_bytes
        result = {"removed_prefixes": 0, "removed_files": 0, "freed_bytes": 0}
        if budget is None:
            return {**result, "disk_bytes": self.disk_bytes(), "budget": -1}
        protected = set(protect)
        removed_files: list[FileRecord] = []
        with self._lock:
            self._refresh_locked()
            if self.index.total_bytes() <= budget:
                return {**result, "disk_bytes": self.index.total_bytes(), "budget": budget}
            now = time.monotonic()
            values: dict[int, float] = {}
            try:
                with self.index.transaction() as conn:
                    while self.index.total_bytes() > budget:
                        candidates = [n for n in self.tree.nodes() if self._evictable(n, protected, now)]
                        if not candidates:
                            log.warning(
                                "the store holds %d bytes, over disk_bytes=%d, but every remaining "
                                "prefix is in use or was just written",
                                self.index.total_bytes(), budget,
                            )
                            break
                        for n in candidates:
                            if n.id not in values:
                                values[n.id] = self._node_value(n)
                        victim = min(candidates, key=lambda n: (values[n.id], n.id))
                        self.tree.remove(victim)
                        self.index.delete_node(conn, victim.id)
                        result["removed_prefixes"] += 1
                        removed_files += self._drop_unreferenced_files(conn)
            except BaseException:
                self._reload_tree_locked()
                raise
            self._forget_files({rec.id for rec in removed_files})
            for rec in removed_files:
                (self.path / CHUNK_DIR / rec.name).unlink(missing_ok=True)
            result["removed_files"] = len(removed_files)
            result["freed_bytes"] = sum(rec.nbytes for rec in removed_files)
            t = self.tier_counters
            t.prefixes_evicted += result["removed_prefixes"]
            t.files_evicted += result["removed_files"]
            t.disk_bytes_evicted += result["freed_bytes"]
            after = self.index.total_bytes()
        if result["removed_prefixes"]:
            log.info(
                "disk budget: removed %d prefix node(s) and %d file(s), freed %d bytes; %d of %d bytes used",
                result["removed_prefixes"], result["removed_files"], result["freed_bytes"], after, budget,
            )
        return {**result, "disk_bytes": after, "budget": budget}

    def _node_kv_keys(self, node: RadixNode) -> list[BlockKey]:
        """K/V blocks (all layers) holding the rows of one node."""
        units = self.layout([Segment(node, len(node.tokens))]).units
        return [(u.file_id, KV, layer, u.block) for layer in range(self.spec.num_layers) for u in units]

    def _node_value(self, node: RadixNode) -> float:
        try:
            keys = self._node_kv_keys(node)
        except CorruptBlockError:
            return -math.inf  # its file is gone: nothing worth keeping
        return sum(self.tiers.priority(k) for k in keys) / max(1, len(keys))

    def _evictable(self, node: RadixNode, protected: set[int], now: float) -> bool:
        if node.children or node.lock_ref > 0 or node.id in protected:
            return False
        if now - self._matched_at.get(node.id, -math.inf) < MATCH_GRACE_S:
            return False
        try:
            keys = self._node_kv_keys(node)
        except CorruptBlockError:
            return True
        return not any(self.tiers.pin_count(k) for k in keys)

    # -- block statistics (cold start) -----------------------------------------------
    def save_block_stats(self) -> int:
        """Write the statistics of the blocks accessed since the last save to the index.

        Runs on `flush`, on `close` and every ``config.stats_interval_s`` seconds while
        blocks are read. Each record holds the access count, the (decayed) frequency,
        the importance share, the age of the last access and the access sequence
        number; `ImpressStore` reloads them when it opens the store.

        Returns
        -------
        int
            Number of block records written.
        """
        with self._lock:
            self._stats_saved_at = self.tiers.now()
            if not self._dirty or self._closed:
                return 0
            dirty, self._dirty = self._dirty, set()
            records = self.tiers.export_stats(dirty)
            return self.index.save_block_stats(records, time.time())

    def _maybe_save_stats(self) -> None:
        interval = self.config.stats_interval_s
        if interval is None or self._closed:
            return
        if self.tiers.now() - self._stats_saved_at < interval:
            return
        self._stats_saved_at = self.tiers.now()
        try:
            self._writer.submit(self._save_stats_quietly)
        except RuntimeError:
            pass  # shutting down: close() saves them

    def _save_stats_quietly(self) -> None:
        try:
            self.save_block_stats()
        except Exception:
            log.warning("saving block statistics failed; they will be saved on the next flush", exc_info=True)

    def _load_block_stats(self) -> int:
        """Install the saved block statistics in the policy (ages include the downtime)."""
        rows = self.index.load_block_stats()
        if not rows:
            return 0
        now = self.tiers.now()
        wall = time.time()
        records: dict[BlockKey, dict[str, Any]] = {}
        for key, rec in rows:
            down = max(0.0, wall - float(rec["saved_at"]))
            records[key] = {
                "count": rec["count"],
                "freq": rec["freq"],
                "share": min(1.0, max(0.0, float(rec["share"]))),
                "seq": rec["seq"],
                "freq_time": now - down,
                "last_access": now - down - float(rec["age_s"]),
            }
        return self.tiers.import_stats(records, now=None)

    # -- warm-up ---------------------------------------------------------------------
    def warmup(self, prompts: Iterable[Any], tokenizer: Any = None) -> dict[str, int]:
        """Pre-populate block statistics and the memory tiers from known prompts.

        Each prompt is matched against the store and every K/V block of its stored
        prefix is read through `read_blocks` (one access per block, with the block's
        current average importance share, 1.0 if unknown), so the blocks enter the
        memory tiers within their budgets and the policy has statistics for them.

        Parameters
        ----------
        prompts:
            Token id sequences (lists, tuples, 1-D tensors or ``[1, n]`` tensors) or,
            with ``tokenizer``, strings.
        tokenizer:
            A Hugging Face tokenizer for string prompts (``tokenizer(prompt)["input_ids"]``).

        Returns
        -------
        dict
            ``prompts`` (matched), ``matched_tokens``, ``blocks`` and
            ``bytes_read_disk``.
        """
        self._check_open()
        summary = {"prompts": 0, "matched_tokens": 0, "blocks": 0, "bytes_read_disk": 0}
        for prompt in prompts:
            tokens = _as_tokens(prompt, tokenizer)
            m = self.match(tokens)
            if m.length == 0:
                continue
            with self.lease([m]):
                lay = self.layout(m.segments)
                for layer in range(self.spec.num_layers):
                    keys = sorted({(u.file_id, KV, layer, u.block) for u in lay.units})
                    shares = [self.tiers.importance_share(k) for k in keys]
                    _, nbytes = self.read_blocks(keys, shares)
                    summary["blocks"] += len(keys)
                    summary["bytes_read_disk"] += nbytes
            summary["prompts"] += 1
            summary["matched_tokens"] += m.length
        log.info("warm-up: %s", summary)
        return summary

    # -- introspection ---------------------------------------------------------------
    def disk_bytes(self) -> int:
        """Bytes of the blocks (K/V and probe copies) in chunk files the index references."""
        return self.index.total_bytes()

    def stats(self) -> dict[str, Any]:
        """Counters of this store since it was opened (or since `reset_stats`).

        Returns
        -------
        dict
            Write and read totals: ``prompts_written``, ``tokens_written``,
            ``bytes_written``, ``bytes_read_disk`` (bytes really read from disk, K/V
            and probe blocks, including alignment gaps of merged reads),
            ``blocks_read`` (blocks read from disk), ``quarantined_files``,
            ``write_seconds``, ``nodes``, ``files``, ``disk_bytes``.

            Block lookups by `read_blocks`, per kind: ``lookups["kv"]`` and
            ``lookups["probe"]`` each hold ``blocks`` and ``bytes`` looked up and, per
            source (``"device"``, ``"host"``, ``"disk"``), ``blocks``, ``bytes``,
            ``hit_ratio`` (blocks served / blocks looked up) and ``byte_hit_ratio``; the
            three sources add up to 1. ``kv_blocks_accessed`` and
            ``kv_bytes_accessed`` repeat the K/V totals.

            Memory tiers (both kinds together): ``policy``;
            ``tiers``: per tier (``"device"``, ``"host"``) ``hits``, ``misses``,
            ``hit_ratio`` (hits / lookups), ``hit_bytes``, ``miss_bytes``,
            ``byte_hit_ratio``, ``evictions``, ``evicted_bytes``, ``used_bytes``,
            ``budget``, ``blocks``, ``class_bytes``; ``"memory"`` the same for both
            tiers together (its misses are disk reads); ``promotions``,
            ``bytes_promoted`` (host to device), ``demotions``, ``bytes_demoted``
            (device to host), ``bytes_moved_between_tiers`` (their sum),
            ``admissions_from_disk``, ``bytes_admitted_from_disk``,
            ``admissions_refused``, ``removals``, ``pinned_blocks``.

            Importance (prefill reads; decode-only reads excluded):
            ``important_rows_needed`` (sum over K/V block accesses of share x rows),
            ``important_rows_device`` / ``_host`` / ``_disk``,
            ``important_kv_hit_rate`` (rows served by a memory tier / rows needed),
            ``important_kv_device_hit_rate``, ``important_kv_host_hit_rate``,
            ``invalid_io_ratio`` (K/V bytes read from disk that the request does not
            attend to, from the shares, over K/V bytes read from disk),
            ``kv_bytes_read_disk``, ``decode_bytes_read_disk``,
            ``probe_bytes_read_disk`` (block sizes, without gaps).

            Disk budget: ``disk_budget`` (``None``: unbounded), ``prefixes_evicted``,
            ``files_evicted``, ``disk_bytes_evicted``.
        """
        out = dict(self.counters.__dict__)
        out.update(nodes=len(self.tree), files=len(self.index.files()), disk_bytes=self.disk_bytes())
        tiers = self.tiers.stats()
        tiers["bytes_moved_between_tiers"] = tiers["bytes_promoted"] + tiers["bytes_demoted"]
        with self._lock:
            t = copy.deepcopy(self.tier_counters)
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
        out.update(
            policy=self.tiers.policy.name,
            tiers=tiers,
            lookups=lookups,
            kv_blocks_accessed=lookups["kv"]["blocks"],
            kv_bytes_accessed=lookups["kv"]["bytes"],
            important_rows_needed=need,
            important_rows_device=t.important_rows_device,
            important_rows_host=t.important_rows_host,
            important_rows_disk=max(0.0, need - mem),
            important_kv_hit_rate=mem / need if need else 0.0,
            important_kv_device_hit_rate=t.important_rows_device / need if need else 0.0,
            important_kv_host_hit_rate=t.important_rows_host / need if need else 0.0,
            invalid_io_ratio=t.kv_bytes_unattended / t.kv_bytes_read_disk if t.kv_bytes_read_disk else 0.0,
            kv_bytes_read_disk=t.kv_bytes_read_disk,
            decode_bytes_read_disk=t.decode_bytes_read_disk,
            probe_bytes_read_disk=t.probe_bytes_read_disk,
            disk_budget=self.config.disk_bytes,
            prefixes_evicted=t.prefixes_evicted,
            files_evicted=t.files_evicted,
            disk_bytes_evicted=t.disk_bytes_evicted,
        )
        return out

    def reset_stats(self) -> None:
        """Zero the counters of `stats` (tier residency and block statistics stay)."""
        with self._lock:
            self.counters = StoreCounters()
            self.tier_counters = TierCounters()
        self.tiers.reset_stats()


def _as_tokens(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("warmup got a string prompt; pass tokenizer=... or token ids")
        return [int(t) for t in tokenizer(prompt)["input_ids"]]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise ValueError(f"warmup takes one prompt per item: 1-D or [1, n] token tensors, got shape {tuple(prompt.shape)}")
        return [int(t) for t in prompt.tolist()]
    return [int(t) for t in prompt]


def _check_kv(spec: ModelSpec, tokens: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    if len(keys) != spec.num_layers or len(values) != spec.num_layers:
        raise ValueError(f"expected K/V for {spec.num_layers} layers, got {len(keys)} and {len(values)}")
    want = (spec.num_kv_heads, len(tokens), spec.head_dim)
    for i, (k, v) in enumerate(zip(keys, values)):
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"layer {i}: expected K/V of shape {want}, got {tuple(k.shape)} and {tuple(v.shape)}")


def _split_probe_infos(infos: list[BlockInfo], probes: list[torch.Tensor], chunk_tokens: int) -> list[BlockInfo]:
    """Index each layer's probe tensor in ``chunk_tokens``-row pieces, one checksum each."""
    out = [i for i in infos if i.kind != PROBE]
    for info in (i for i in infos if i.kind == PROBE):
        raw = probes[info.layer]
        rec = raw.shape[1]
        for b, start in enumerate(range(0, raw.shape[0], chunk_tokens)):
            part = raw[start : start + chunk_tokens]
            out.append(
                BlockInfo(PROBE, info.layer, b, part.shape[0], info.offset + start * rec, part.numel(), crc32(tensor_bytes(part)))
            )
    return out


def drop_page_cache(store_dir: str | os.PathLike[str]) -> None:
    """Evict a store's chunk files from this machine's page cache.

    ``fsync`` then ``POSIX_FADV_DONTNEED`` on every chunk file, so the next reads come from
    the device ("guest-cold": in a VM the hypervisor may still cache them). Used by the
    demo and the benchmarks to measure cold reads.
    """
    for f in (Path(store_dir) / CHUNK_DIR).iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
