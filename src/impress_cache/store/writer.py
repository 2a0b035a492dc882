"""The write path: a prompt's K/V to a new chunk file and the index, on one background thread.

For each prompt the writer keeps only the rows after the part already stored, cuts them
into blocks of ``chunk_tokens`` rows per layer, encodes the probe-key copy, writes a new
chunk file under a temporary name, fsyncs it, renames it, fsyncs the directory and only
then commits the file, its blocks and the radix nodes in one index transaction. If the
transaction fails, the in-memory tree is reloaded from the index and the file is removed.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .. import probe as probe_codec
from ..config import ImpressConfig
from ..index.radix import RadixNode
from ..model_info import ModelSpec
from ..storage.base import PROBE, BlockData, BlockInfo, ChunkFormat, checksum, fsync_path, iter_blocks, tensor_bytes
from .binding import ProbeSpec
from .catalog import Catalog

log = logging.getLogger(__name__)


@dataclass
class WriteCounters:
    """Totals of the writes since the store was opened (or since `reset_stats`)."""

    prompts_written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0


#: called after a commit with the new file's id, its blocks and the new leaf
OnWritten = Callable[[int, list[BlockInfo], RadixNode | None], None]


class PromptWriter:
    """Writes prompts in a background thread; `flush` waits and re-raises failures."""

    def __init__(
        self,
        catalog: Catalog,
        config: ImpressConfig,
        spec: ModelSpec,
        probe: ProbeSpec,
        fmt: ChunkFormat,
        on_written: OnWritten,
    ) -> None:
        self._catalog = catalog
        self._config = config
        self._spec = spec
        self._probe = probe
        self._fmt = fmt
        self._on_written = on_written
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="impress-write")
        self._pending: list[Future[None]] = []
        self.counters = WriteCounters()

    def submit(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> Future[None]:
        tokens = tuple(int(t) for t in tokens)
        check_kv(self._spec, tokens, keys, values)
        fut = self._pool.submit(self._write_logged, tokens, keys, values)
        with self._catalog.lock:
            # finished writes are dropped unless they failed: flush() re-raises those
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None] + [fut]
        return fut

    def background(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the writer thread (ignored once the writer is closed)."""
        try:
            self._pool.submit(fn)
        except RuntimeError:
            pass

    def flush(self) -> None:
        """Block until every submitted prompt is written; re-raise the first failure."""
        while True:
            with self._catalog.lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            for fut in pending:
                fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- one prompt ------------------------------------------------------------------
    def _write_logged(self, tokens: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        try:
            self.write(tokens, keys, values)
        except Exception:
            log.exception("storing a prompt of %d tokens failed; the store is unchanged", len(tokens))
            raise

    def write(self, tokens: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        catalog = self._catalog
        m = catalog.match(tokens).length
        if m == len(tokens):
            self._commit(tokens, None, None, m)
            return
        dtype = self._spec.torch_kv_dtype
        ks = [k[:, m:].to("cpu", dtype) for k in keys]
        vs = [v[:, m:].to("cpu", dtype) for v in values]
        ct = self._config.chunk_tokens
        blocks = list(iter_blocks(ks, vs, ct))
        # each layer's probe copy is one contiguous tensor (no per-block alignment gaps),
        # indexed in chunk_tokens pieces so that each piece has its own checksum
        probes = [probe_codec.encode(k[list(self._probe.kv_heads)], self._probe.encoding) for k in ks]
        for layer, raw in enumerate(probes):
            blocks.append(BlockData(PROBE, layer, -1, raw.shape[0], torch.uint8, tuple(raw.shape), tensor_bytes(raw)))
        name = f"{uuid.uuid4().hex}.{self._fmt.suffix}"
        final = catalog.chunks / name
        tmp = final.with_name(name + ".tmp")
        meta = {"tokens_from": str(m), "n_tokens": str(len(tokens) - m), "chunk_tokens": str(ct)}
        try:
            infos = split_probe_infos(self._fmt.write(tmp, blocks, meta), probes, ct)
            os.replace(tmp, final)
            if self._config.fsync:
                fsync_path(final.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        done = self._commit(tokens, (name, infos), final, m)
        if done is None:
            return
        file_id, leaf = done
        c = self.counters
        c.prompts_written += 1
        c.tokens_written += len(tokens) - m
        c.bytes_written += sum(i.nbytes for i in infos)
        c.write_seconds += time.perf_counter() - t0
        self._on_written(file_id, infos, leaf)

    def _commit(
        self, tokens: tuple[int, ...], new_file: tuple[str, list[BlockInfo]] | None, final: Any, m: int
    ) -> tuple[int, RadixNode | None] | None:
        """Index the prompt in one transaction; returns ``(file_id, leaf)`` when the new
        file was committed, ``None`` when it was not needed (and is removed)."""
        catalog = self._catalog
        with catalog.lock:
            try:
                with catalog.index.transaction() as conn:
                    catalog.refresh()
                    m2 = catalog.tree.match(tokens).length
                    if new_file is not None and m2 < m:
                        # part of the prefix we matched was deleted meanwhile: our file lacks those rows
                        log.warning("prefix changed while writing; dropping a %d-token write", len(tokens) - m)
                        final.unlink(missing_ok=True)
                        return None
                    if new_file is None or m2 == len(tokens):
                        if final is not None:
                            final.unlink(missing_ok=True)
                        catalog.insert(conn, tokens, file_id=-1)
                        return None
                    name, infos = new_file
                    file_id = catalog.index.add_file(
                        conn, name, self._fmt.suffix, len(tokens) - m, self._config.chunk_tokens, infos
                    )
                    leaf = catalog.insert(conn, tokens, file_id, file_row_of_first_new=m2 - m)
            except BaseException:
                catalog.reload_tree()
                if final is not None:
                    final.unlink(missing_ok=True)
                raise
        return file_id, leaf


def check_kv(spec: ModelSpec, tokens: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Raise ``ValueError`` unless keys and values have one ``[kv_heads, tokens, head_dim]``
    tensor per layer."""
    if len(keys) != spec.num_layers or len(values) != spec.num_layers:
        raise ValueError(f"expected K/V for {spec.num_layers} layers, got {len(keys)} and {len(values)}")
    want = (spec.num_kv_heads, len(tokens), spec.head_dim)
    for i, (k, v) in enumerate(zip(keys, values)):
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"layer {i}: expected K/V of shape {want}, got {tuple(k.shape)} and {tuple(v.shape)}")


def split_probe_infos(infos: list[BlockInfo], probes: list[torch.Tensor], chunk_tokens: int) -> list[BlockInfo]:
    """Index each layer's probe tensor in ``chunk_tokens``-row pieces, one checksum each."""
    out = [i for i in infos if i.kind != PROBE]
    for info in (i for i in infos if i.kind == PROBE):
        raw = probes[info.layer]
        rec = raw.shape[1]
        for b, start in enumerate(range(0, raw.shape[0], chunk_tokens)):
            part = raw[start : start + chunk_tokens]
            out.append(
                BlockInfo(PROBE, info.layer, b, part.shape[0], info.offset + start * rec, part.numel(), checksum(tensor_bytes(part)))
            )
    return out

