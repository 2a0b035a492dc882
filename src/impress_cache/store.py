"""ImpressStore: the persistent prefix KV store on disk.

It ties together the SQLite index (`index`), the radix tree
(`radix`) and the chunk-file formats (`storage`).
It knows nothing about ``generate``: `ImpressCache` asks it
for the longest stored prefix of a prompt, for those rows' K/V, and hands it the K/V of
new prompts to keep.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
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
from .layout import PrefixLayout
from .radix import Match, RadixTree, Segment
from .storage import FORMATS, BlockInfo, BlockReader, ReadRequest, iter_blocks
from .storage.base import KV, PROBE, BlockData, crc32, fsync_path, tensor_bytes

log = logging.getLogger(__name__)

INDEX_NAME = "index.sqlite"
CHUNK_DIR = "chunks"
QUARANTINE_DIR = "quarantine"


@dataclass
class _OpenFile:
    record: FileRecord
    path: Path
    blocks: dict[tuple[int, int], BlockInfo]


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

    Notes
    -----
    The store is a context manager; `close` waits for pending writes.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        config: ImpressConfig | None = None,
        storage_format: str = "safetensors",
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
        self.counters = StoreCounters()
        self._closed = False
        self.tree: RadixTree = self.index.load_tree()
        self._remove_orphans()
        log.info("opened store %s: %d nodes, %d files", self.path, len(self.tree), len(self.index.files()))

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
        """Finish pending writes and release files. Safe to call twice."""
        if self._closed:
            return
        self.flush()
        self._writer.shutdown(wait=True)
        self.fetcher.shutdown(wait=True)
        self._reader.close()
        self.index.close()
        self._closed = True

    def flush(self) -> None:
        """Block until every prompt handed to `put_async` is on disk and indexed."""
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            for fut in pending:
                fut.result()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the store at {self.path} is closed")

    # -- lookups ---------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """Longest stored prefix of ``tokens`` (at most ``limit`` tokens)."""
        self._check_open()
        with self._lock:
            self._refresh()
            return self.tree.match(tokens, limit)

    def chunk_tokens_of(self, file_id: int) -> int:
        return self._open_file(file_id).record.chunk_tokens

    def layout(self, segments: Sequence[Segment]) -> PrefixLayout:
        """Units (file blocks) holding a matched prefix; see `PrefixLayout`."""
        return PrefixLayout(segments, self.chunk_tokens_of)

    def read_blocks(
        self, keys: Sequence[BlockKey], shares: Sequence[float] | None = None
    ) -> tuple[list[memoryview], int]:
        """Read blocks ``(file_id, kind, layer, block)`` with coalesced ``preadv``.

        ``shares`` gives, per key, the fraction of the block's rows the request attends
        to (its importance share; ``None`` means all rows).
        Returns each block's verified bytes (in ``keys`` order) and the bytes read.
        Raises `CorruptBlockError` naming the file of a missing or damaged block.
        """
        self._check_open()
        requests = []
        for file_id, kind, layer, block in keys:
            f = self._open_file(file_id)
            info = f.blocks.get((kind, layer, block))
            if info is None:
                raise CorruptBlockError(f"block {kind}/{layer}/{block} of file {f.path} is not indexed", file_id)
            requests.append(ReadRequest(file_id, f.path, info.offset, info.nbytes, info.crc32))
        views, nbytes = self._reader.read(requests)
        with self._lock:
            self.counters.bytes_read_disk += nbytes
            self.counters.blocks_read += len(requests)
        return views, nbytes

    def kv_block(self, view: memoryview) -> torch.Tensor:
        """View a K/V block's bytes as ``[2, kv_heads, rows, head_dim]``."""
        spec = self.spec
        return torch.frombuffer(view, dtype=spec.torch_kv_dtype).view(2, spec.num_kv_heads, -1, spec.head_dim)

    def load(
        self,
        segments: Sequence[Segment],
        layers: Sequence[int] | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        memo: dict[BlockKey, memoryview] | None = None,
    ) -> LoadedPrefix:
        """Read every K/V row of ``segments`` (a match, possibly cut shorter).

        Returns ``[layers, kv_heads, tokens, head_dim]`` tensors in the stored dtype,
        written into ``out`` (a pair of tensors, or views, of that shape) when given.
        Blocks found in ``memo`` (already read by this request) are not read again.
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
        memo = {} if memo is None else memo
        missing = sorted({key for key in keys_of if key not in memo})
        views, nbytes = self.read_blocks(missing)
        memo.update(zip(missing, views))
        for key, (li, u) in zip(keys_of, wanted):
            block = self.kv_block(memo[key])
            rows = slice(u.first_row, u.first_row + u.count)
            keys[li, :, u.start : u.start + u.count] = block[0, :, rows]
            values[li, :, u.start : u.start + u.count] = block[1, :, rows]
        return LoadedPrefix(keys, values, nbytes, len(missing), time.perf_counter() - t0, layers)

    def load_probes(self, layout: PrefixLayout, layers: Sequence[int] | None = None) -> tuple[list[torch.Tensor], int]:
        """Probe-key records of a prefix: per layer ``uint8 [tokens, record_bytes]``."""
        layers = list(range(self.spec.num_layers)) if layers is None else list(layers)
        rec = self.probe.record_bytes
        out = [torch.empty((layout.length, rec), dtype=torch.uint8) for _ in layers]
        wanted = [(li, u) for li in range(len(layers)) for u in layout.units]
        views, nbytes = self.read_blocks([(u.file_id, PROBE, layers[li], u.block) for li, u in wanted])
        for view, (li, u) in zip(views, wanted):
            block = torch.frombuffer(view, dtype=torch.uint8).view(-1, rec)
            out[li][u.start : u.start + u.count] = block[u.first_row : u.first_row + u.count]
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
                self.tree = self.index.load_tree()
                raise
        self.counters.prompts_written += 1
        self.counters.tokens_written += len(tokens) - m
        self.counters.bytes_written += sum(i.nbytes for i in infos)
        self.counters.write_seconds += time.perf_counter() - t0

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
            locks = {n.id: n.lock_ref for n in self.tree.nodes() if n.lock_ref}
            self.tree = self.index.load_tree()
            for node_id, ref in locks.items():
                try:
                    self.tree.node(node_id).lock_ref = ref
                except KeyError:
                    pass
            self._files.clear()

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
            unreferenced = self.index.unreferenced_files(conn)
            for fid in unreferenced:
                rec = self.index.file(fid)
                self.index.delete_file(conn, fid)
                self._files.pop(fid, None)
                if rec is not None and fid != file_id:
                    (self.path / CHUNK_DIR / rec.name).unlink(missing_ok=True)
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

    def _remove_orphans(self) -> None:
        """Delete temp files and chunk files the index does not know (crash leftovers)."""
        known = {f.name for f in self.index.files()}
        for p in (self.path / CHUNK_DIR).iterdir():
            if p.name not in known:
                log.info("removing unindexed file %s (left by an interrupted write)", p.name)
                p.unlink(missing_ok=True)

    # -- introspection ---------------------------------------------------------------
    def disk_bytes(self) -> int:
        """Bytes of K/V in chunk files referenced by the index."""
        return self.index.total_bytes()

    def stats(self) -> dict[str, Any]:
        """Counters of this store since it was opened."""
        out = dict(self.counters.__dict__)
        out.update(nodes=len(self.tree), files=len(self.index.files()), disk_bytes=self.disk_bytes())
        return out

    def reset_stats(self) -> None:
        self.counters = StoreCounters()


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
