"""The reorganiser: rewrites a radix node's rows, per layer, most important first.

Block selection reads whole blocks; when a prefix's important rows are scattered, a 25 %
selection touches many blocks. IMPRESS sorts the rows inside each radix node by their
importance over past requests, so later requests find their important rows packed into
the node's first blocks. Here a node is a candidate once ``reorg_min_requests`` sparse
requests have added to its statistics (`ImportanceStats`) since its order was last
decided, and it is rewritten when the new order is expected to pack the top rows into at
least ``reorg_min_gain`` fewer blocks: for ``k = important_ratio x length`` rows of each
layer, the blocks holding its ``k`` most important rows now versus after the rewrite,
averaged over layers.

A rewrite never crosses node boundaries (prefix sharing stays valid): it reads the
node's rows (checksums verified, outside the memory tiers and the I/O counters), writes
them to a new chunk file in the new order with the permutation in its header and the
index (temporary name, fsync, rename), then one index transaction replaces the node by
one pointing at the new file (`Catalog.replace_node`). Readers that matched the old node
keep reading the old file, which is unlinked once no node references it and no lease
holds it. The keys are stored after RoPE, so rows keep their positions for attention.

Rewrites yield to requests: they start once the store has been idle for
``reorg_idle_ms`` and wait again before every block they write. One process at a time
rewrites a store (an exclusive ``flock`` on ``reorg.lock``).
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ImpressError
from ...index.radix import RadixNode
from ...index.sqlite import FileRecord, NewFile
from ..activity import Activity
from ..catalog import Catalog
from .importance import ImportanceStats

log = logging.getLogger(__name__)

LOCK_NAME = "reorg.lock"

#: reads a node's rows in prompt order: ``(keys, values, bytes read)``, ``keys[layer]``
#: ``[kv_heads, length, head_dim]``; calls its argument before each layer
ReadNode = Callable[[RadixNode, Callable[[], None]], tuple[list[torch.Tensor], list[torch.Tensor], int]]
#: writes rows to a new chunk file (`PromptWriter.write_rows`)
WriteRows = Callable[..., tuple[NewFile, str]]
#: called after a commit: (old node, new node, new file id, dropped files, order)
OnReplaced = Callable[[RadixNode, RadixNode, int, list[FileRecord], np.ndarray], None]


@dataclass
class ReorgCounters:
    """Totals of the rewrites since the store was opened (or since `reset_stats`)."""

    reorganisations: int = 0
    bytes_rewritten: int = 0
    bytes_read: int = 0
    rewrite_seconds: float = 0.0
    #: rewrites dropped because the node changed meanwhile (split, removed, rewritten)
    abandoned: int = 0


@dataclass(frozen=True)
class Plan:
    """One node's rewrite: its new order and the blocks its top rows need before/after."""

    node: RadixNode
    order: np.ndarray
    blocks_now: float
    blocks_after: float

    @property
    def gain(self) -> float:
        return 0.0 if self.blocks_now <= 0 else 1.0 - self.blocks_after / self.blocks_now


def top_blocks(top: np.ndarray, phys: np.ndarray, chunk_tokens: int, file_row: int = 0) -> float:
    """Mean over layers of the blocks holding the rows ``top[layer]`` (logical rows of a
    node) when logical row ``r`` is physical row ``phys[layer, file_row + r]``."""
    rows = np.take_along_axis(phys[:, file_row:], top, axis=1) // chunk_tokens
    return float(np.mean([len(np.unique(r)) for r in rows]))


class Reorganizer:
    """Plans and runs rewrites of one store's nodes; optionally in a background thread."""

    def __init__(
        self,
        root: Path,
        catalog: Catalog,
        importance: ImportanceStats,
        activity: Activity,
        read_node: ReadNode,
        write_rows: WriteRows,
        on_replaced: OnReplaced,
        *,
        layers: int,
        chunk_tokens: int,
        important_ratio: float,
        idle_s: float,
        min_requests: int,
        min_gain: float,
    ) -> None:
        self._root = root
        self._catalog = catalog
        self._importance = importance
        self._activity = activity
        self._read_node = read_node
        self._write_rows = write_rows
        self._on_replaced = on_replaced
        self._layers = layers
        self._ct = chunk_tokens
        self._ratio = important_ratio
        self.idle_s = idle_s
        self.min_requests = min_requests
        self.min_gain = min_gain
        self._busy = threading.Lock()  # one rewrite at a time in this process
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = ReorgCounters()

    # -- planning ----------------------------------------------------------------------
    def plan(self, node: RadixNode) -> Plan | None:
        """The rewrite of ``node`` its statistics call for (``None``: none gathered)."""
        stats = self._importance.get(node.id)
        if stats is None or stats.scores.shape != (self._layers, node.length):
            return None
        n = node.length
        order = np.argsort(-stats.scores, axis=1, kind="stable")  # ties keep prompt order
        k = max(1, min(n, math.ceil(self._ratio * n)))
        top = order[:, :k]
        perm = self._catalog.perm_of(node.file_id)
        ct_now = self._catalog.chunk_tokens_of(node.file_id)
        phys = perm.astype(np.int64) if perm is not None else np.broadcast_to(
            np.arange(node.file_row + n, dtype=np.int64), (self._layers, node.file_row + n)
        )
        now = top_blocks(top, phys, ct_now, node.file_row)
        after = float(-(-k // self._ct))  # the top k rows fill the first blocks
        return Plan(node, order, now, after)

    def candidates(self, force: bool = False) -> list[Plan]:
        """Nodes worth rewriting, best first. Without ``force`` a node needs
        ``min_requests`` new requests and an expected gain of ``min_gain``; nodes that
        have the requests but not the gain are marked as decided. ``force`` takes every
        node with statistics whose order would change anything."""
        catalog = self._catalog
        with catalog.lock:
            catalog.refresh()
            # statistics of nodes that are gone (evicted, quarantined, split or replaced
            # by another process) are dropped here, once per pass
            self._importance.keep_only(lambda i: catalog.tree.get(i) is not None)
            ids = self._importance.pending(1 if force else self.min_requests)
            nodes = [catalog.tree.get(i) for i in ids]
        plans = []
        for node in nodes:
            if node is None or node.parent is None:
                continue
            p = self.plan(node)
            if p is None:
                continue
            if p.gain >= (1e-9 if force else self.min_gain):
                plans.append(p)
            elif not force:
                self._importance.settle(node.id)
        return sorted(plans, key=lambda p: -p.gain * p.node.length)

    # -- rewriting -----------------------------------------------------------------------
    def run(self, force: bool = False, limit: int | None = None, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Rewrite the candidate nodes (at most ``limit``). Returns ``rewritten``,
        ``abandoned``, ``bytes_rewritten``, ``seconds`` and ``busy`` (True when another
        process or thread was rewriting this store: nothing was done)."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {"rewritten": 0, "abandoned": 0, "bytes_rewritten": 0, "busy": False}
        lock = self._acquire()
        if lock is None:
            return {**out, "busy": True, "seconds": 0.0}
        try:
            plans = self.candidates(force)
            for p in plans[:limit]:
                try:
                    nbytes = self._rewrite(p)
                except _Stopped:
                    break
                except (ImpressError, OSError) as exc:  # e.g. its file was evicted or damaged meanwhile
                    log.warning("reordering node %d failed (%s); it keeps its order", p.node.id, exc)
                    self._importance.settle(p.node.id)  # not tried again before new requests
                    self.counters.abandoned += 1
                    nbytes = None
                if nbytes is None:
                    out["abandoned"] += 1
                else:
                    out["rewritten"] += 1
                    out["bytes_rewritten"] += nbytes
                if progress is not None:
                    progress(1)
                if self._stop.is_set():
                    break
        finally:
            self._release(lock)
        out["seconds"] = time.perf_counter() - t0
        return out

    def _rewrite(self, p: Plan) -> int | None:
        """Rewrite one node; returns the bytes written, ``None`` if the node changed."""
        t0 = time.perf_counter()
        node = p.node
        between = self._between
        path, n = node.path_tokens(), node.length
        ks, vs, nbytes_read = self._read_node(node, between)
        with self._catalog.gate.creating():  # (the leftover scan waits)
            new_file, name = self._write_rows(path, len(path) - n, ks, vs, p.order, between)
            done = self._catalog.commit_or_discard(name, lambda: self._catalog.replace_node(node, new_file))
        c = self.counters
        c.bytes_read += nbytes_read
        if done is None:
            c.abandoned += 1
            log.info("node %d changed while it was rewritten; the rewrite is dropped", node.id)
            return None
        file_id, new, dropped = done
        self._catalog.files.seed(file_id, new_file)  # (its first read reads no block table back)
        self._on_replaced(node, new, file_id, dropped, p.order)
        c.reorganisations += 1
        c.bytes_rewritten += new_file.file_bytes
        c.rewrite_seconds += time.perf_counter() - t0
        log.info(
            "reordered node %d (%d rows) into file %d: top rows in %.1f instead of %.1f blocks per layer",
            node.id, n, file_id, p.blocks_after, p.blocks_now,
        )
        return new_file.file_bytes

    def _between(self) -> None:
        """Before each block: wait while requests run (the rewrite is background work);
        abandon the rewrite when the store closes."""
        if not self._activity.wait_idle(self.idle_s, self._stop):
            raise _Stopped

    def _acquire(self) -> int | None:
        """This process's and the store's rewrite lock, or ``None`` if either is taken."""
        if not self._busy.acquire(blocking=False):
            return None
        try:
            fd = os.open(self._root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except BaseException:
            self._busy.release()
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._busy.release()
            return None
        return fd

    def _release(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
            self._busy.release()

    # -- in the background -----------------------------------------------------------------
    def start(self) -> None:
        """Rewrite candidates whenever the store has been idle for ``idle_s``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="impress-reorg", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """New statistics arrived: look for candidates once the store is idle."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            if self._stop.is_set() or not self._activity.wait_idle(self.idle_s, self._stop):
                return
            try:
                result = self.run(limit=1)
            except Exception:
                log.exception("reorganising the store failed; it stays as it was")
                result = {"rewritten": 0, "busy": False}
            if not result["rewritten"] and not result.get("abandoned"):
                if result["busy"]:
                    self._stop.wait(1.0)  # another process is rewriting: look again later
                else:
                    self._wake.clear()  # nothing to do until new statistics arrive


class _Stopped(Exception):
    """The store is closing: a rewrite in progress is abandoned (its file removed)."""


def block_shares(order: np.ndarray, important_ratio: float, chunk_tokens: int) -> np.ndarray:
    """``[layers, blocks]``: the share of each block of a reordered node that holds its
    ``important_ratio`` most important rows (the blocks' starting importance shares)."""
    layers, n = order.shape
    k = max(1, min(n, math.ceil(important_ratio * n)))
    nb = -(-n // chunk_tokens)
    rows = np.minimum(chunk_tokens, n - np.arange(nb) * chunk_tokens)
    top = np.minimum(rows, np.maximum(0, k - np.arange(nb) * chunk_tokens))
    return np.broadcast_to(top / rows, (layers, nb))


