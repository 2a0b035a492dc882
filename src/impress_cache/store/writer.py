"""The write path: a prompt's K/V to a new chunk file and the index, on one background thread.

For each prompt the writer keeps only the rows after the part already stored, cuts them
into blocks of ``chunk_tokens`` rows per layer, encodes the probe-key copy, checksums
every block with a seed that binds it to this file, these tokens and its place
(`storage.base.block_seeds`), writes a new chunk file under a temporary name whose
header describes it completely (tokens, positions, checksums, model), fsyncs it, renames
it, fsyncs the directory and only then commits the file and the radix nodes in one index
transaction. The in-memory tree changes only after that commit; if anything fails before
it, the file is removed and the store is as it was. A failure after the commit never
removes the file (`Catalog.commit_prompt`, `Catalog.discard`): the prompt stays stored.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import probe as probe_codec
from ..config import ImpressConfig
from ..errors import ImpressError, StoreLimitError
from ..index.guard import NO_ROOM, WAY_OUT, room_left
from ..storage.reader import TRANSIENT
from ..index.radix import RadixNode, as_tokens
from ..index.sqlite import NewFile
from ..model_info import ModelSpec
from ..storage.base import KV, MAX_BLOCKS, MAX_LAYERS, PROBE, BlockData, ChunkFormat, block_seeds, checksum, context_digest, disk_bytes, file_seed, iter_blocks, tensor_bytes
from .activity import Activity
from .binding import ProbeSpec
from .catalog import Catalog
from .directory import create_file, publish
from .header import FILE_FORMAT, b64

log = logging.getLogger(__name__)



@dataclass
class WriteCounters:
    """Totals of the writes since the store was opened (or since `reset_stats`)."""

    prompts_written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    #: prompts not stored because the disk or the index refused the write (ENOSPC, EIO, a failed commit)
    write_failures: int = 0


#: called after a commit with the new file's id, its blocks per layer and the new leaf
OnWritten = Callable[[int, int, RadixNode | None], None]


class InFlight:
    """The prompts handed to the writer and not written yet (the sequences they store),
    so that a lookup can wait for the one write that would give it a longer match."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: dict[Future[None], np.ndarray] = {}
        #: the writer thread (a lookup there never waits: it would wait for itself)
        self.thread: int | None = None

    def add(self, fut: Future[None], tokens: np.ndarray) -> None:
        with self._lock:
            self._writes[fut] = tokens
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[None]) -> None:
        with self._lock:
            self._writes.pop(fut, None)

    def __len__(self) -> int:
        return len(self._writes)

    def longer(self, tokens: np.ndarray, have: int) -> Future[None] | None:
        """A pending write that stores more than ``have`` leading tokens of ``tokens``
        (the one giving most, the last submitted of those), or None."""
        with self._lock:
            writes = list(self._writes.items())
        best, gain = None, have
        for fut, stored in writes:  # (the last of those giving most: a job after a write, e.g. its state checkpoint)
            n = common_length(stored, tokens)
            if n > have and n >= gain and not fut.done():
                best, gain = fut, n
        return best

    def wait_for(self, tokens: np.ndarray, have: Callable[[], int], timeout: float) -> float:
        """Wait (at most ``timeout`` seconds in all) while a pending write would give
        ``tokens`` a longer match than ``have()`` (the committed one); returns the
        seconds waited (0.0: nothing to wait for). A write that fails just ends the wait
        for it; nothing half-written is ever looked at (``have`` sees commits only)."""
        if timeout <= 0 or not self._writes or threading.get_ident() == self.thread:
            return 0.0
        t0 = time.perf_counter()
        deadline, waited = t0 + timeout, False
        now = have()
        while (fut := self.longer(tokens, now)) is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            waited = True
            if not wait([fut], timeout=left).done:
                break
            now = have()
        return time.perf_counter() - t0 if waited else 0.0


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """Leading elements two token arrays share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n




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
        activity: Activity | None = None,
    ) -> None:
        self._catalog = catalog
        self._config = config
        self._spec = spec
        self._probe = probe
        self._fmt = fmt
        self._on_written = on_written
        self._activity = activity
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="impress-write")
        #: the jobs a `flush` waits for, and ``_scan_error``, under a lock of their own
        #: (not the catalog's: a job the writer thread runs may hold that one for long)
        self._jobs_lock = threading.Lock()
        self._pending: list[Future[None]] = []
        self.counters = WriteCounters()
        self._warned = False
        #: the crash-leftover scan while it has not run (`start_scan`)
        self._scan: Callable[[], bool] | None = None
        #: what a scan retried before a write raised (`flush` raises it)
        self._scan_error: Exception | None = None
        #: the prompts submitted and not written yet (`InFlight.wait_for`)
        self.inflight = InFlight()

    def submit(
        self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor], valid_from: int = 0
    ) -> Future[None]:
        arr = as_tokens(tokens).copy()
        check_kv(self._spec, len(arr), keys, values)
        fut = self._pool.submit(self._write_logged, arr, keys, values, valid_from)
        self.inflight.add(fut, arr)
        with self._jobs_lock:
            # finished writes are dropped unless they failed: flush() re-raises those
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None] + [fut]
        return fut

    def start_scan(self, scan: Callable[[], bool], now: bool = False) -> None:
        """Run the crash-leftover scan ``scan`` (`leftovers.remove_leftovers`) as this
        thread's first job, or ``now`` (its exception raised here). While it returns False
        (a writer, of this or another process, was creating a file) it is tried again
        before each write. `flush` re-raises what it raised on this thread."""
        self._scan = scan
        if now:
            self._try_scan()
            if self._scan is None:
                return
        fut = self._pool.submit(self._try_scan)
        with self._jobs_lock:
            self._pending.append(fut)

    def _try_scan(self) -> None:
        scan, self._scan = self._scan, None
        try:
            done = scan is None or scan()
        except OSError as exc:
            if exc.errno not in TRANSIENT or isinstance(exc, ImpressError):
                raise
            log.debug("removing crash leftovers waits (%s); tried again before the next write", exc)
            done = False  # out of descriptors or memory for a moment: not a reason to fail
        if not done:
            self._scan = scan

    def submit_job(self, fn: Callable[[], Any], tokens: Sequence[int] | None = None) -> Future[Any]:
        """Run ``fn`` on the writer thread after the writes submitted before it; `flush`
        waits for it (and raises what it raised). A job about a sequence (``tokens``: a
        state checkpoint) is waited for like a write of it (`InFlight`)."""
        fut = self._pool.submit(fn)
        if tokens is not None:
            self.inflight.add(fut, as_tokens(tokens).copy())
        with self._jobs_lock:
            self._pending.append(fut)
        return fut

    def background(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the writer thread (ignored once the writer is closed)."""
        try:
            self._pool.submit(fn)
        except RuntimeError:
            pass

    def flush(self) -> None:
        """Block until every submitted prompt is written or dropped. Writes the disk or
        the index refused are counted (``write_failures``) and logged, not raised; any
        other failure (a bug, or what the crash-leftover scan found that the store did not
        write) is raised once every job has finished."""
        error: BaseException | None = None
        while True:
            with self._jobs_lock:
                pending, self._pending = self._pending, []
                error, self._scan_error = error or self._scan_error, None
            if not pending:
                if error is not None:
                    raise error
                return
            for fut in pending:  # every job is waited for; the first failure is raised after
                error = error or fut.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- one prompt ------------------------------------------------------------------
    def _write_logged(
        self, tokens: np.ndarray, keys: list[torch.Tensor], values: list[torch.Tensor], valid_from: int = 0
    ) -> None:
        self.inflight.thread = threading.get_ident()
        if self._scan is not None:  # held off by another writer so far
            try:
                self._try_scan()
            except Exception as exc:  # noqa: BLE001 - never fails the write; not tried again, raised by flush
                log.exception("removing crash leftovers from %s failed", self._catalog.chunks)
                with self._jobs_lock:
                    self._scan_error = exc
        if self._activity is not None:
            self._activity.enter()
        try:
            self.write(tokens, keys, values, valid_from)
        except (OSError, ImpressError) as exc:  # disk full, I/O error, a failed commit
            self.counters.write_failures += 1
            if not self._warned:
                self._warned = True
                no_room = isinstance(exc, OSError) and not isinstance(exc, ImpressError) and exc.errno in NO_ROOM
                log.warning(
                    "storing a prompt of %d tokens failed, so it is not stored; the store is unchanged and "
                    "keeps serving (later failures are logged at debug level): %s%s", len(tokens), exc,
                    room_left(self._catalog.chunks) + WAY_OUT if no_room else "",
                )
            else:
                log.debug("storing a prompt of %d tokens failed: %s", len(tokens), exc)
        except Exception:
            log.exception("storing a prompt of %d tokens failed; the store is unchanged", len(tokens))
            raise
        finally:
            if self._activity is not None:
                self._activity.leave()

    def write(self, tokens: np.ndarray, keys: list[torch.Tensor], values: list[torch.Tensor], valid_from: int = 0) -> None:
        t0 = time.perf_counter()
        catalog = self._catalog
        m = catalog.match(tokens).length
        if m < valid_from:  # rows the request never held would be needed: store nothing
            log.debug("not storing a prompt of %d tokens: %d of them are stored, %d needed", len(tokens), m, valid_from)
            return
        if m == len(tokens):
            return  # stored already: nothing to write, no transaction
        with catalog.gate.creating():  # (the leftover scan waits)
            new_file, final = self._write_file(tokens, m, keys, values)
            # raises only when nothing was committed: a failure after the commit is handled
            # there (logged, counted, tree reloaded) and the file stays
            done = catalog.commit_or_discard(
                final, lambda: catalog.commit_prompt(tokens, m, new_file, self._config.disk_bytes)
            )
            if done is None:  # stored meanwhile by another writer, or its prefix was removed
                return
        file_id, leaf = done
        catalog.files.seed(file_id, new_file)  # (the first match reads no block table back)
        c = self.counters
        c.prompts_written += 1
        c.tokens_written += len(tokens) - m
        c.bytes_written += new_file.file_bytes
        c.write_seconds += time.perf_counter() - t0
        self._on_written(file_id, new_file.offsets.shape[2], leaf)

    def _write_file(
        self, tokens: np.ndarray, m: int, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> tuple[NewFile, str]:
        """Write the rows from position ``m`` on to a new chunk file; returns its index
        record and its name (already renamed into place)."""
        dtype = self._spec.torch_kv_dtype
        ks = [k[:, m:].to("cpu", dtype) for k in keys]
        vs = [v[:, m:].to("cpu", dtype) for v in values]
        return self.write_rows(tokens, m, ks, vs)

    def write_rows(
        self,
        tokens: np.ndarray,
        m: int,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
        order: np.ndarray | None = None,
        between: Callable[[], None] | None = None,
    ) -> tuple[NewFile, str]:
        """Write rows ``m ..`` of the sequence ``tokens`` to a new chunk file (temporary
        name, fsync, rename, fsync of the directory); returns its index record and name.

        ``ks[layer]`` / ``vs[layer]`` are the rows' ``[kv_heads, len(tokens) - m,
        head_dim]`` K/V in prompt order (CPU, the store's dtype). With ``order``
        (``int [layers, rows]``), layer ``l``'s physical row ``j`` holds logical row
        ``order[l, j]``: the file is reordered and records the inverse permutation.
        ``between`` is called before each block is written (see `ChunkFormat.write`).
        """
        spec, ct = self._spec, self._config.chunk_tokens
        rows = tokens[m:]
        n, layers = len(rows), spec.num_layers
        perm = None
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            if order.shape != (layers, n) or not (np.sort(order, axis=1) == np.arange(n)).all():
                raise ValueError(f"order must hold a permutation of {n} rows for each of {layers} layers")
            perm = np.argsort(order, axis=1).astype(np.int32)
            idx = [torch.from_numpy(order[layer]) for layer in range(layers)]
            ks = [k.index_select(1, i) for k, i in zip(ks, idx)]
            vs = [v.index_select(1, i) for v, i in zip(vs, idx)]
        nb = -(-n // ct)
        if nb > MAX_BLOCKS or layers > MAX_LAYERS:
            raise StoreLimitError(
                f"a chunk file holds at most {MAX_BLOCKS} blocks per layer and {MAX_LAYERS} layers; {n} rows in "
                f"blocks of {ct} and {layers} layers do not fit (raise chunk_tokens)"
            )
        file_uuid = uuid.uuid4()
        context = context_digest(tokens[:m])
        seeds = block_seeds(
            file_seed(file_uuid.bytes, context, m, rows, perm), *np.indices((2, layers, nb))
        )
        checksums = np.zeros((2, layers, nb), dtype=np.uint32)
        blocks = list(iter_blocks(ks, vs, ct, spec.kv_codec))  # encoded before the checksums: they cover the stored bytes
        for blk in blocks:
            checksums[KV, blk.layer, blk.block] = checksum(blk.payload, int(seeds[KV, blk.layer, blk.block]))
        # each layer's probe copy is one contiguous tensor (no per-block alignment gaps),
        # addressed in chunk_tokens-row pieces so that each piece has its own checksum
        probes = [probe_codec.encode(k[list(self._probe.kv_heads)], self._probe.encoding) for k in ks]
        for layer, raw in enumerate(probes):
            for b in range(nb):
                piece = tensor_bytes(raw[b * ct : (b + 1) * ct])
                checksums[PROBE, layer, b] = checksum(piece, int(seeds[PROBE, layer, b]))
            blocks.append(BlockData(PROBE, layer, -1, raw.shape[0], torch.uint8, tuple(raw.shape), tensor_bytes(raw)))
        name = f"{file_uuid.hex}.{self._fmt.suffix}"
        meta = {
            "impress_cache": FILE_FORMAT,
            "uuid": file_uuid.hex,
            "model": json.dumps(spec.to_dict(), sort_keys=True),
            "probe": json.dumps({
                "query_heads": list(self._probe.query_heads), "kv_heads": list(self._probe.kv_heads),
                "encoding": self._probe.encoding,
            }),
            "first_pos": str(m),
            "n_tokens": str(n),
            "chunk_tokens": str(ct),
            "layers": str(layers),
            "tokens": b64(tokens, "<i4"),
            "checksums": b64(checksums, "<u4"),
        }
        if perm is not None:
            meta["perm"] = b64(perm, "<i4")
        catalog = self._catalog
        tmp = name + ".tmp"
        try:
            # created here with the store's mode (the format then truncates, fills and fsyncs it)
            os.close(create_file(catalog.chunks_fd, tmp, self._config.file_mode))
            placed = self._fmt.write(catalog.chunks / tmp, blocks, meta, between)
            offsets = np.zeros((2, layers, nb), dtype=np.int64)
            for blk, off in zip(blocks, placed):
                if blk.kind == KV:
                    offsets[KV, blk.layer, blk.block] = off
                else:
                    offsets[PROBE, blk.layer] = off + np.arange(nb) * ct * self._probe.record_bytes
            st = os.stat(tmp, dir_fd=catalog.chunks_fd)
            file_bytes = disk_bytes(st)
            publish(catalog.chunks_fd, tmp, name, self._config.fsync)
        except BaseException:
            catalog.unlink(tmp)
            raise
        nbytes = sum(b.nbytes for b in blocks)
        new_file = NewFile(name, self._fmt.suffix, m, rows, context, ct, layers, offsets, checksums, nbytes, file_bytes, perm)
        return new_file, name


def check_kv(spec: ModelSpec, n_tokens: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Raise ``ValueError`` unless keys and values have one ``[kv_heads, tokens, head_dim]``
    tensor per layer."""
    if len(keys) != spec.num_layers or len(values) != spec.num_layers:
        raise ValueError(f"expected K/V for {spec.num_layers} layers, got {len(keys)} and {len(values)}")
    want = (spec.num_kv_heads, n_tokens, spec.head_dim)
    for i, (k, v) in enumerate(zip(keys, values)):
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"layer {i}: expected K/V of shape {want}, got {tuple(k.shape)} and {tuple(v.shape)}")
