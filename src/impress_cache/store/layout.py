"""Where the rows of a matched prefix live: logical positions -> (file, block, row), per layer.

A matched prefix is a list of radix-tree segments, each a run of logical rows of one chunk
file. Files are cut into blocks of their own ``chunk_tokens`` physical rows. In a file
written in prompt order, logical row ``r`` is physical row ``r`` in every layer; a file
rewritten by the reorganiser (`store.reorder`) keeps each layer's rows in its own order
(most important first), with ``perm[layer, r]``, the physical row of logical row ``r``.

The prefix's *units* are the (file, block) pairs that hold any of its rows in any layer:
the smallest things that can be read. `PrefixLayout.at(layer)` gives a `LayerView`: the
unit and the row inside the unit's block of every logical position for that layer, and
the gathers that copy rows out of blocks read. Layers of files in prompt order share one
view, whose positions come in contiguous runs (fast strided copies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..index.radix import Segment
from ..storage.base import KV, BlockKey, block_code
from .blockset import BlockSet


@dataclass(frozen=True)
class Unit:
    """Block ``block`` of chunk file ``file_id``."""

    file_id: int
    block: int


class PrefixLayout:
    """Units of one matched prefix, and per layer where every logical position lives."""

    def __init__(
        self,
        segments: Sequence[Segment],
        chunk_tokens_of: Callable[[int], int],
        perm_of: Callable[[int], np.ndarray | None] = lambda file_id: None,
    ) -> None:
        #: the radix-tree segments this layout was built from
        self.segments = list(segments)
        self.length = sum(seg.length for seg in self.segments)
        self._parts: list[tuple[int, int, int, int, int, np.ndarray | None]] = []  # file, ct, r0, length, pos, perm
        index: dict[tuple[int, int], int] = {}
        units: list[Unit] = []
        pos = 0
        for seg in self.segments:
            ct = chunk_tokens_of(seg.file_id)
            perm = perm_of(seg.file_id) if seg.length else None
            r0, r1 = seg.file_row, seg.file_row + seg.length
            if perm is None:
                blocks = range(r0 // ct, (r1 - 1) // ct + 1) if seg.length else range(0)
            else:
                blocks = np.unique(perm[:, r0:r1] // ct).tolist()
            for b in blocks:
                if (seg.file_id, b) not in index:
                    index[(seg.file_id, b)] = len(units)
                    units.append(Unit(seg.file_id, int(b)))
            self._parts.append((seg.file_id, ct, r0, seg.length, pos, perm))
            pos += seg.length
        self._index = index
        #: the (file, block) pairs holding the prefix's rows in some layer
        self.units = units
        #: per unit: its file and its block in that file (numpy, for the read path)
        self.unit_files = np.array([u.file_id for u in units], dtype=np.int64)
        self.unit_blocks = np.array([u.block for u in units], dtype=np.int64)
        #: whether every layer keeps the rows in prompt order
        self.in_order = all(p[5] is None for p in self._parts)
        self._views: dict[int, LayerView] = {}

    def parts(self) -> list[tuple[int, int, int, int]]:
        """``(file_id, chunk_tokens, first file row, rows)`` of each non-empty segment, in
        order (in a file in prompt order, the rows of every layer)."""
        return [(f, ct, r0, n) for f, ct, r0, n, _, _ in self._parts if n]

    def at(self, layer: int) -> LayerView:
        """Where every position of ``layer`` lives (one shared view when in order)."""
        key = -1 if self.in_order else layer
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = LayerView(self, None if self.in_order else layer)
        return view

    def keys(self, units: Sequence[int], kind: int, layer: int) -> list[BlockKey]:
        """Block keys of ``units`` for one layer."""
        return [(self.units[u].file_id, kind, layer, self.units[u].block) for u in units]

    def codes(self, units: Sequence[int], layer: int) -> list[int]:
        """`block_code` of the blocks of ``units`` for one layer."""
        u = np.asarray(units, dtype=np.int64)
        return block_code(self.unit_files[u], layer, self.unit_blocks[u]).tolist()

    def _placement(self, layer: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Unit and row inside its block of every position (``layer=None``: prompt order)."""
        unit_of = np.empty(self.length, dtype=np.int64)
        row_of = np.empty(self.length, dtype=np.int64)
        for file_id, ct, r0, n, pos, perm in self._parts:
            if n == 0:
                continue
            if perm is None or layer is None:
                phys = np.arange(r0, r0 + n, dtype=np.int64)
            else:
                phys = perm[layer, r0 : r0 + n].astype(np.int64)
            blocks = phys // ct
            present = np.unique(blocks)
            ids = np.array([self._index[(file_id, int(b))] for b in present], dtype=np.int64)
            unit_of[pos : pos + n] = ids[np.searchsorted(present, blocks)]
            row_of[pos : pos + n] = phys - blocks * ct
        return unit_of, row_of


def _rows_of(out: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A ``[2, heads, k, dim]`` view whose rows (after ``k`` rows of a head, ``room``
    rows of nothing else) tile one contiguous span of memory: that span as ``[rows,
    dim]`` and the room; ``None`` for any other layout (or a dtype/device a copy must
    convert)."""
    two, heads, k, dim = out.shape
    if out.stride(3) != 1 or out.stride(2) != dim or k == 0 or dim == 0:
        return None
    per_head = out.stride(1)
    if per_head % dim or per_head < k * dim or out.stride(0) != heads * per_head:
        return None
    r = per_head // dim
    span = (two * heads - 1) * r + k
    return out.as_strided((span, dim), (dim, 1)), r - k


class LayerView:
    """One layer of a `PrefixLayout`: the unit and in-block row of every position."""

    def __init__(self, layout: PrefixLayout, layer: int | None) -> None:
        self.layout = layout
        self.units = layout.units
        self.length = layout.length
        unit_of, row_of = layout._placement(layer)
        #: unit index of every logical position
        self.unit_of = torch.from_numpy(unit_of)
        #: row, inside its unit's block, of every logical position
        self.row_of = torch.from_numpy(row_of)
        #: per unit: how many positions of this layer it holds
        self.unit_count = torch.bincount(self.unit_of, minlength=len(layout.units))
        #: positions in prompt order: each unit's positions are one contiguous run
        self.in_order = layer is None
        if self.in_order and self.length:
            first = np.flatnonzero(np.r_[True, unit_of[1:] != unit_of[:-1]])
            self._runs = list(zip(unit_of[first].tolist(), first.tolist(), row_of[first].tolist(),
                                  np.diff(np.r_[first, self.length]).tolist()))
        else:
            self._runs = []
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._placement_np = (unit_of, row_of)
        #: how many units hold a position of this layer
        self.present_units = int(np.count_nonzero(self.unit_count.numpy()))
        self._kept_units: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def units_of_kept(self, positions: torch.Tensor) -> torch.Tensor:
        """Sorted units holding ``positions``, a tensor that is never modified (the rows
        always kept: `selectors.kept_rows` hands out one per prefix length), remembered
        per tensor."""
        got = self._kept_units.get(id(positions))
        if got is None or got[0] is not positions:
            got = self._kept_units[id(positions)] = (positions, torch.unique(self.unit_of[positions]))
        return got[1]

    def unit_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([units, S] positions, [units] present)``, computed once: for every unit and
        every row of its block a position of this layer inside that unit (the row's own
        position when the prefix holds it, otherwise another position of the same unit,
        which changes neither a minimum nor a maximum over the unit). Units without a
        position in this layer point at position 0 and are marked absent."""
        if self._table is None:
            n_units, p = len(self.units), self.length
            s = int(self.row_of.max()) + 1 if p else 1
            table = torch.full((n_units, s), -1, dtype=torch.long)
            table[self.unit_of, self.row_of] = torch.arange(p, dtype=torch.long)
            some = table.max(dim=1, keepdim=True).values  # any position of the unit, -1 if none
            self._table = (torch.where(table >= 0, table, some.clamp(min=0)), some.squeeze(1) >= 0)
        return self._table

    def units_for(self, positions: torch.Tensor) -> list[int]:
        """Sorted indices of the units holding ``positions``."""
        return torch.unique(self.unit_of[positions]).tolist()

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """In prompt order, each run of positions one unit holds: ``(unit, first
        position, first row in the unit's block, rows)`` as int64 arrays; ``None`` for a
        reordered layer."""
        if not self.in_order:
            return None
        cols = np.array(self._runs, dtype=np.int64).reshape(-1, 4)
        return cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]

    def units_all(self) -> list[int]:
        """The units holding any position of this layer."""
        return torch.nonzero(self.unit_count).squeeze(1).tolist()

    def row_index(
        self, units: Sequence[int], slots: Sequence[int], slot_rows: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Where ``positions`` are among slots of ``slot_rows`` rows holding ``units``.

        ``slots[i]`` is the slot of unit ``units[i]``. Returns ``slot * slot_rows + row``
        for every position, with the shape of ``positions`` (default: every position).
        """
        if positions is None:
            positions = torch.arange(self.length)
        base = torch.full((len(self.units),), -1, dtype=torch.long)
        base[torch.as_tensor(list(units), dtype=torch.long)] = torch.as_tensor(list(slots), dtype=torch.long) * slot_rows
        b = base[self.unit_of[positions]]
        if bool((b < 0).any()):
            raise ValueError("a position lies in a unit whose block was not given")
        return b + self.row_of[positions]

    def gather(
        self, units: Sequence[int], blocks: BlockSet, positions: torch.Tensor | None = None, offset: int = 0,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``positions`` from K/V blocks read for ``units``.

        The blocks of ``units`` are the keys ``offset .. offset + len(units)`` of
        ``blocks`` (in unit order). ``positions`` is ``[k]`` (the same rows for every
        head), ``[heads, k]`` (one set per head) or ``None`` (every position, in order).
        Returns two ``[heads, k, head_dim]`` tensors (new memory, on the pool's device),
        or, with ``out`` (a ``[2, heads, k, head_dim]`` tensor or view), ``out[0]`` and
        ``out[1]`` filled. When ``out`` is ``k`` rows of a ``[2, heads, R, head_dim]``
        buffer (a layer's buffer with room for new rows) the rows go there with no copy
        in between, and the buffer's other rows between one head's ``k`` and the next's
        get arbitrary rows of the pool (the new tokens' keys and values overwrite them).
        """
        if blocks.kind != KV:
            raise ValueError("gather reads K/V blocks; use gather_rows for probe pieces")
        pool = blocks.placed().pool
        _, _, heads, s, dim = pool.shape
        # a slot holds [2, heads, s] rows: the row of (kv, head, position) is the slot's
        # first row + (kv * heads + head) * s + the position's row in its block (the index
        # is built in numpy: a few small operations, each a fraction of a torch one's cost)
        idx = self._row_index_np(units, blocks.slot_of[offset : offset + len(units)], 2 * heads * s, positions)
        k = idx.shape[-1]
        flat = idx.reshape(1, -1, k) + np.arange(0, 2 * heads * s, s).reshape(2, heads, 1)  # [2, H, k]
        rows = pool.reshape(-1, dim)
        if out is None:
            got = rows.index_select(0, torch.from_numpy(flat.reshape(-1)).to(pool.device)).view(2, heads, k, dim)
            return got[0], got[1]
        dense = _rows_of(out) if out.dtype == pool.dtype and out.device == pool.device else None
        if dense is None:
            out.copy_(rows.index_select(0, torch.from_numpy(flat.reshape(-1)).to(pool.device)).view(2, heads, k, dim))
        else:
            target, room = dense
            if room:  # the room rows take row 0 of the pool
                flat = np.concatenate([flat, np.zeros((2, heads, room), dtype=flat.dtype)], axis=2)
            at = torch.from_numpy(flat.reshape(-1)[: target.shape[0]]).to(pool.device)
            torch.index_select(rows, 0, at, out=target)
        return out[0], out[1]

    def _row_index_np(
        self, units: Sequence[int], slots: Sequence[int], slot_rows: int, positions: torch.Tensor | None
    ) -> np.ndarray:
        """`row_index` as an int64 numpy array."""
        base = np.full(len(self.units), -1, dtype=np.int64)
        base[np.asarray(units, dtype=np.int64)] = np.asarray(slots, dtype=np.int64) * slot_rows
        unit_of, row_of = self._placement_np
        if positions is None:
            b, r = base[unit_of], row_of
        else:
            pos = positions.detach().cpu().numpy()
            b, r = base[unit_of[pos]], row_of[pos]
        if (b < 0).any():
            raise ValueError("a position lies in a unit whose block was not given")
        return b + r

    def gather_into(self, units: Sequence[int], blocks: BlockSet, out: torch.Tensor, offset: int = 0) -> None:
        """Every position (in order) into ``out``, a ``[2, heads, positions, head_dim]``
        tensor or view (keys, then values), from the blocks read for ``units`` (keys
        ``offset ..`` of ``blocks``; every unit of the layer).

        In prompt order, runs of whole blocks are stacked straight into ``out`` (one copy
        per run, no index), whether they sit in the pool or were held apart (memory-tier
        hits), and units that cover part of a block are copied one by one; a reordered
        layer is gathered with one index.
        """
        if not self.in_order:
            k, v = self.gather(units, blocks, None, offset)
            out[0].copy_(k)
            out[1].copy_(v)
            return
        s = blocks.slot_rows
        slot_of = dict(zip(units, blocks.slot_of[offset : offset + len(units)]))
        runs, pos, i, n = self._runs, 0, 0, len(self._runs)
        while i < n:
            j = i
            while j < n and runs[j][2] == 0 and runs[j][3] == s:
                j += 1
            if j > i:  # whole blocks i .. j - 1
                nb = j - i
                torch.stack(
                    [blocks.slot(slot_of[u])[:, :, :s] for u, _, _, _ in runs[i:j]], dim=2,
                    out=out[:, :, pos : pos + nb * s].unflatten(2, (nb, s)),
                )
                pos += nb * s
                i = j
                continue
            u, _, r, c = runs[i]
            out[:, :, pos : pos + c].copy_(blocks.slot(slot_of[u])[:, :, r : r + c])
            pos += c
            i += 1

    def gather_rows(
        self, units: Sequence[int], blocks: BlockSet, positions: torch.Tensor | None = None, offset: int = 0
    ) -> torch.Tensor:
        """``[k, record]`` rows of probe pieces read for ``units`` (keys ``offset ..`` of
        ``blocks``, in unit order)."""
        pool = blocks.placed().pool
        idx = self.row_index(units, blocks.slot_of[offset : offset + len(units)], blocks.slot_rows, positions)
        return pool.reshape(-1, pool.shape[-1]).index_select(0, idx.to(pool.device))

    def blocks_from(self, keys: torch.Tensor, values: torch.Tensor, units: Sequence[int]) -> BlockSet:
        """The blocks of ``units`` cut from in-memory ``[heads, positions, head_dim]`` keys
        and values, as the read path returns them (one slot per unit, in order): what a
        request uses when it had to recompute its prefix."""
        units = list(units)
        slot = torch.full((len(self.units),), -1, dtype=torch.long)
        slot[torch.as_tensor(units, dtype=torch.long)] = torch.arange(len(units))
        pos = torch.nonzero(slot[self.unit_of] >= 0).squeeze(1)
        s = int(self.row_of[pos].max()) + 1 if len(pos) else 1
        h, _, d = keys.shape
        pool = torch.zeros(len(units), 2, h, s, d, dtype=keys.dtype, device=keys.device)
        sl, rows = slot[self.unit_of[pos]], self.row_of[pos]
        pool[sl, 0, :, rows] = keys[:, pos].transpose(0, 1)
        pool[sl, 1, :, rows] = values[:, pos].transpose(0, 1)
        used = torch.zeros(len(units), dtype=torch.long).scatter_reduce(0, sl, rows + 1, "amax")
        return BlockSet(KV, pool, used.tolist(), list(range(len(units))))
