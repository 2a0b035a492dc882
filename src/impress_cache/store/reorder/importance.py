"""Accumulated row importance per radix node and layer: what the reorganiser sorts by.

Every sparse prefill hands the store, per layer, which prefix positions its probe scores
rank in the top ``k`` (the rows token selection would load; block selection's choice
depends on the current layout, these do not). The store adds them to the statistics of
the radix nodes the positions lie in: one ``float16 [layers, node length]`` array per
node that requests have used sparsely. Like the score policy's frequencies, the sums
halve every ``half_life_s`` seconds (``None``: plain counts), so an order reflects
recent requests. ``pending`` counts the requests since the node's order was last
decided; the reorganiser looks at a node again only once it has enough of them.

A split node's halves take their columns of its statistics; a rewritten node's
replacement takes them whole. The statistics are saved to the index with the block
statistics and read again after the store opened (``saved``, a `DeferredLoad`: on the
writer thread, or by the first call that needs them, before it changes anything; saved
rows with impossible values are skipped).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ...index.locks import STATISTICS, OrderedLock
from ...index.radix import Segment
from ..saved import DeferredLoad


@dataclass
class NodeImportance:
    """Decayed per-row sums of one node (``[layers, length]``) and its request counts."""

    scores: np.ndarray
    requests: float
    pending: int
    at: float


class ImportanceStats:
    """Per-node importance of one store (thread-safe)."""

    def __init__(self, layers: int, half_life_s: float | None, clock: Callable[[], float]) -> None:
        self.layers = layers
        self.half_life_s = half_life_s
        self._clock = clock
        self._lock = OrderedLock(STATISTICS, "importance statistics", reentrant=False)
        self._nodes: dict[int, NodeImportance] = {}
        self.dirty: set[int] = set()
        #: the saved statistics (``read()`` gives them as `_install` takes them), read after
        #: open by the first call below that needs them
        self.saved = DeferredLoad("importance statistics", self._lock, self._install)

    def _ensure(self) -> None:
        """(Not under the lock.) The saved statistics first (`DeferredLoad.load`)."""
        self.saved.load()

    def __len__(self) -> int:
        self._ensure()
        return len(self._nodes)

    def __contains__(self, node_id: int) -> bool:
        self._ensure()
        return node_id in self._nodes

    def _decay(self, e: NodeImportance, now: float) -> None:
        if self.half_life_s is not None and now > e.at:
            f = 0.5 ** ((now - e.at) / self.half_life_s)
            e.scores = (e.scores.astype(np.float32) * f).astype(np.float16)
            e.requests *= f
        e.at = now

    def add(self, segments: Sequence[Segment], importance: np.ndarray) -> None:
        """Add one request's ``[layers, positions]`` importance to the nodes of its matched
        ``segments`` (which cover the positions in order, each from its node's start)."""
        self._ensure()
        now = self._clock()
        pos = 0
        with self._lock:
            for seg in segments:
                node = seg.node
                e = self._nodes.get(node.id)
                if e is None or e.scores.shape[1] != node.length:
                    e = self._nodes[node.id] = NodeImportance(
                        np.zeros((self.layers, node.length), np.float16), 0.0, 0, now
                    )
                self._decay(e, now)
                part = e.scores[:, : seg.length].astype(np.float32) + importance[:, pos : pos + seg.length]
                e.scores[:, : seg.length] = part.astype(np.float16)
                e.requests += 1.0
                e.pending += 1
                self.dirty.add(node.id)
                pos += seg.length

    def get(self, node_id: int) -> NodeImportance | None:
        """A copy of a node's statistics, decayed to now."""
        self._ensure()
        with self._lock:
            e = self._nodes.get(node_id)
            if e is None:
                return None
            self._decay(e, self._clock())
            return NodeImportance(e.scores.astype(np.float32), e.requests, e.pending, e.at)

    def pending(self, min_requests: int) -> list[int]:
        """Nodes with at least ``min_requests`` requests since their order was decided."""
        self._ensure()
        with self._lock:
            return [k for k, e in self._nodes.items() if e.pending >= min_requests]

    def settle(self, node_id: int) -> None:
        """The node's order was decided (rewritten, or judged good enough)."""
        self._ensure()
        with self._lock:
            e = self._nodes.get(node_id)
            if e is not None:
                e.pending = 0
                self.dirty.add(node_id)

    def split(self, old_id: int, new_ids: tuple[int, ...], k: int) -> None:
        """A node's rows now live in ``new_ids``: two halves split after ``k`` rows take
        their columns; one node (its rows rewritten) takes them all."""
        self._ensure()
        with self._lock:
            e = self._nodes.pop(old_id, None)
            self.dirty.discard(old_id)
            if e is None:
                return
            parts = (e.scores[:, :k], e.scores[:, k:]) if len(new_ids) == 2 else (e.scores,)
            for node_id, cols in zip(new_ids, parts):
                self._nodes[node_id] = NodeImportance(cols.copy(), e.requests, e.pending, e.at)
                self.dirty.add(node_id)

    def forget(self, node_ids: Iterable[int]) -> None:
        self._ensure()
        with self._lock:
            for node_id in node_ids:
                self._nodes.pop(node_id, None)
                self.dirty.discard(node_id)

    def keep_only(self, alive: Callable[[int], bool]) -> None:
        """Drop the statistics of nodes no longer in the tree (after a reload)."""
        self._ensure()
        with self._lock:
            for node_id in [k for k in self._nodes if not alive(k)]:
                del self._nodes[node_id]
                self.dirty.discard(node_id)

    def unsaved(self, node_ids: Iterable[int]) -> None:
        """Mark exported statistics as changed again (their save failed)."""
        with self._lock:
            self.dirty.update(node_ids)

    def export(self) -> dict[int, tuple[np.ndarray, float, int]]:
        """The statistics changed since the last export, decayed to now."""
        with self._lock:
            now = self._clock()
            dirty, self.dirty = self.dirty, set()
            out = {}
            for node_id in dirty:
                e = self._nodes.get(node_id)
                if e is not None:
                    self._decay(e, now)
                    out[node_id] = (e.scores, e.requests, e.pending)
            return out

    def _install(self, records: dict[int, tuple[np.ndarray, float, int, float]]) -> int:
        """(Under the lock, by ``saved``.) Install saved statistics (``saved_at``
        wall-clock seconds: the time the store was closed counts toward the decay), each
        a record of ``layers`` rows (`saved.possible_importance`)."""
        now, wall = self._clock(), time.time()
        for node_id, (scores, requests, pending, saved_at) in records.items():
            if node_id in self._nodes:  # recorded since open (a read that failed first): newer
                continue
            at = now - max(0.0, wall - saved_at)
            self._nodes[node_id] = NodeImportance(scores.astype(np.float16, copy=False), float(requests), int(pending), at)
        return len(records)
