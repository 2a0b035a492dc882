"""Slabs: the K/V blocks of one chunk file's layer held contiguously in the memory tiers.

When a read admits K/V blocks it took from disk, each run of consecutive blocks of one
(file, layer) is copied into one ``[2, kv_heads, rows, head_dim]`` tensor, the *slab*,
and the tiers get views of it as the blocks' payloads (the same bytes the blocks took
one by one: the tiers' accounting is unchanged). If every block of the run is admitted,
the run is bound as a tier group (`tiers.groups`) whose data is the slab. A dense
request whose rows of a (file, layer) lie in an intact group then gets them as one view
of the slab (`Slabs.rows`): one call to the tiers that records the blocks' accesses
without work per block, and one copy into the layer's buffer.

A slab is never served stale: the first of its blocks evicted, moved between tiers or
dropped (file deleted or quarantined) dissolves the group inside the tiers, the blocks
still resident get copies of their own, and `Slabs.rows` misses; the request then reads
the blocks one by one (memory tiers, then disk) as any read does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch

from ..storage.base import KV
from ..tiers import TierManager


@dataclass(frozen=True)
class Slab:
    """Rows of blocks ``first ..`` of one (file, layer), ``chunk`` rows per block (every
    block but the last of a run of several is whole: its file's ``chunk_tokens``)."""

    first: int
    chunk: int
    tensor: torch.Tensor  # [2, kv_heads, rows, head_dim]

    @property
    def rows(self) -> int:
        return self.tensor.shape[2]


class Slabs:
    """The slabs a store formed, found by (file, layer); their life is the tiers' call."""

    def __init__(self, tiers: TierManager, pin: bool = False) -> None:
        self._tiers = tiers
        self._pin = pin
        self._lock = threading.Lock()
        #: ``(file_id, layer) -> {first block: blocks}`` of groups bound (some may be gone)
        self._index: dict[tuple[int, int], dict[int, int]] = {}
        self._entries = 0

    def form(
        self, pool: torch.Tensor, slots: np.ndarray, files: np.ndarray, layers: np.ndarray, blocks: np.ndarray,
        rows: np.ndarray,
    ) -> tuple[list[torch.Tensor], list[tuple[Hashable, list[int], Slab]]]:
        """Copy the K/V blocks in ``slots`` of ``pool`` (sorted, read from disk) into slabs.

        Returns each slot's payload (a view of its slab, in ``slots`` order) and the runs
        to bind once the payloads are admitted: ``(group, positions in slots, slab)``.
        A run is consecutive slots of one (file, layer) with consecutive blocks, every
        block but the last one whole (``rows`` equal to the first's)."""
        _, _, h, s, d = pool.shape
        f, la, b, r, sl = files[slots], layers[slots], blocks[slots], rows[slots], slots
        payloads: list[torch.Tensor] = []
        runs: list[tuple[Hashable, list[int], Slab]] = []
        for a, z in _runs(sl, f, la, b, r, s):
            m = z - a
            total = int(r[a:z].sum())
            slab = torch.empty((2, h, total, d), dtype=pool.dtype, device=pool.device, pin_memory=self._pin)
            whole = m - 1 if int(r[z - 1]) < s else m
            lo = int(sl[a])
            if whole:
                slab[:, :, : whole * s].unflatten(2, (whole, s)).copy_(pool[lo : lo + whole].permute(1, 2, 0, 3, 4))
            if whole < m:
                last = int(r[z - 1])
                slab[:, :, whole * s :].copy_(pool[lo + whole, :, :, :last])
            payloads.extend(slab[:, :, i * s : min((i + 1) * s, total)] for i in range(m))
            group = (int(f[a]), KV, int(la[a]), int(b[a]))
            runs.append((group, list(range(a, z)), Slab(int(b[a]), s, slab)))
        return payloads, runs

    def regroup(
        self, hits: list[tuple[int, torch.Tensor]], files: np.ndarray, layers: np.ndarray, blocks: np.ndarray,
        keys: list[Hashable], slot_rows: int,
    ) -> None:
        """Runs of memory-tier hits ``(slot, block)`` (sorted by slot) whose blocks are in
        no group (a slab dissolved, blocks read apart) become one slab each again: one
        copy, payloads replaced under the tiers' lock (`TierManager.regroup`)."""
        if not hits:
            return
        sl = np.fromiter((x for x, _ in hits), dtype=np.int64, count=len(hits))
        r = np.fromiter((blk.shape[2] for _, blk in hits), dtype=np.int64, count=len(hits))
        f, la, b = files[sl], layers[sl], blocks[sl]
        bound = []
        for a, z in _runs(sl, f, la, b, r, slot_rows):
            if z - a < 2:
                continue
            group = (int(f[a]), KV, int(la[a]), int(b[a]))

            def make(current: list[torch.Tensor], first: int = int(b[a])) -> tuple[list[torch.Tensor], Slab]:
                slab = torch.cat(current, dim=2)
                if self._pin and slab.device.type == "cpu":
                    slab = slab.pin_memory()
                views, at = [], 0
                for blk in current:
                    views.append(slab[:, :, at : at + blk.shape[2]])
                    at += blk.shape[2]
                return views, Slab(first, slot_rows, slab)

            if self._tiers.regroup(group, [keys[int(x)] for x in sl[a:z]], make):
                bound.append((group, z - a))
        self._register(bound)

    def bind(self, runs: list[tuple[Hashable, list[int], Slab]], keys: list[Hashable], payloads: list[torch.Tensor]) -> None:
        """Bind each run whose blocks the tiers admitted as a group (`TierManager.bind_group`)."""
        bound = []
        for group, pos, slab in runs:
            if self._tiers.bind_group(group, [keys[i] for i in pos], [payloads[i] for i in pos], slab):
                bound.append((group, len(pos)))
        self._register(bound)

    def _register(self, bound: list[tuple[Hashable, int]]) -> None:
        if not bound:
            return
        with self._lock:
            for (file_id, _, layer, first), count in bound:
                self._index.setdefault((file_id, layer), {})[first] = count
                self._entries += 1
            if self._entries > 2 * self._tiers.group_count + 256:
                self._prune()

    def rows(
        self, file_id: int, layer: int, r0: int, n: int, chunk: int, share: float | None = 1.0
    ) -> list[tuple[torch.Tensor, str, tuple[Hashable, ...], int]] | None:
        """Rows ``r0 .. r0 + n`` of a (file, layer) as views of intact slabs that follow
        each other (most often one), each with the tier it is in, the keys of its blocks
        used (counted as hits and accessed with ``share``) and those blocks' rows; or
        ``None`` (some block is in no slab)."""
        lo, hi = r0 // chunk, (r0 + n - 1) // chunk
        with self._lock:
            runs = self._index.get((file_id, layer))
            if runs is None:
                return None
            plan, at = [], lo
            while at <= hi:
                first = next((x for x, cnt in runs.items() if x <= at < x + cnt), None)
                if first is None:
                    return None
                plan.append((first, at, min(hi, first + runs[first] - 1)))
                at = plan[-1][2] + 1
        out = []
        for first, a, z in plan:
            hit = self._tiers.group_hit((file_id, KV, layer, first), a - first, z - first + 1, share)
            if hit is None:
                self._forget(file_id, layer, first)
                return None
            slab, tier, keys = hit
            start = max(r0, a * chunk) - first * chunk
            stop = min(r0 + n, (z + 1) * chunk) - first * chunk
            block_rows = min((z + 1) * chunk, first * chunk + slab.rows) - a * chunk
            out.append((slab.tensor[:, :, start:stop], tier, keys, block_rows))
        return out

    def _forget(self, file_id: int, layer: int, first: int) -> None:
        with self._lock:
            runs = self._index.get((file_id, layer))
            if runs is not None and runs.pop(first, None) is not None:
                self._entries -= 1
                if not runs:
                    del self._index[(file_id, layer)]

    def _prune(self) -> None:
        """Drop index entries of groups the tiers dissolved (under ``_lock``)."""
        alive: Callable[[Hashable], bool] = self._tiers.group_intact
        for (file_id, layer), runs in list(self._index.items()):
            for first in [x for x in runs if not alive((file_id, KV, layer, x))]:
                del runs[first]
                self._entries -= 1
            if not runs:
                del self._index[(file_id, layer)]


def _runs(slots: np.ndarray, files: np.ndarray, layers: np.ndarray, blocks: np.ndarray, rows: np.ndarray, whole: int) -> list[tuple[int, int]]:
    """``[a, z)`` ranges of consecutive slots of one (file, layer) with consecutive blocks,
    every block but the last ``whole`` rows long."""
    n = len(slots)
    cut = np.ones(n, dtype=bool)
    if n > 1:
        cut[1:] = (files[1:] != files[:-1]) | (layers[1:] != layers[:-1]) | (blocks[1:] != blocks[:-1] + 1) | (
            slots[1:] != slots[:-1] + 1) | (rows[:-1] != whole)
    starts = np.flatnonzero(cut).tolist() + [n]
    return list(zip(starts[:-1], starts[1:]))
