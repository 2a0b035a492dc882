"""A sparse prefill: each layer's prefix rows chosen with the new tokens' queries.

Built by `PrefixRequest` when a request loads fewer than all of its reused rows. A
`ProbeLoader` reads and decodes the probe-key copies ahead of the layers; during the
prefill the hooks hand each layer's post-RoPE queries to `capture`, and the layer's
first ``update`` calls `select`, which picks and loads that layer's rows for every batch
row (`select_row`). Blocks read here are kept (``memo``) so that the background read of
the whole prefix for ``decode="full"`` does not read them again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import CacheUsageError, CorruptBlockError
from ..selection.bounds import BlockSummaries
from ..selection.modes import BASELINES
from ..selection.selectors import RowSelection, select_row, top_masks
from ..stats import RequestStats
from ..storage.base import KV
from ..store.blocks import PendingRead
from ..store.blockset import BlockSet, ReadStats, invalid_io_ratio
from ..store.layout import PrefixLayout
from ..store.store import ImpressStore
from .hooks import hooks_installed
from .loaders import ProbeLoader, prefix_buffer
from .reselect import Reselector, reselects


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block with at most ``n`` intra-op CPU threads (``None``: as set)."""
    before = torch.get_num_threads()
    if n is None or n >= before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rows_of(ranking: torch.Tensor | Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """A layer's `RowSelection.ranking` as ``[P]`` scores."""
    return ranking() if callable(ranking) else ranking


class SparsePrefill:
    """``k`` prefix rows per layer; per batch row its layout."""

    def __init__(
        self,
        store: ImpressStore,
        k: int,
        layouts: list[PrefixLayout | None],
        probes: ProbeLoader | None,
        stats: RequestStats,
        room: int,
        batch: Any,
    ) -> None:
        self.store = store
        #: the request: its ``rows`` map the running batch to the planned rows
        self._batch = batch
        self.k = k
        self.layouts = layouts
        self.probes = probes
        self.stats = stats
        self.room = room
        #: blocks this request has read, by key (the decode-time read skips them)
        self.memo: dict[int, torch.Tensor] = {}
        #: only a later read of the same blocks uses them: the whole prefix for
        #: ``decode="full"``, or a layer's own read after its read-ahead
        self._keep_memo = store.config.decode == "full" or bool(store.config.prefetch)
        #: ``selections[layer][batch_row]``: prefix positions attended (relative to the
        #: row's first real token; ``[k]`` shared or ``[kv_heads, k]``)
        self.selections: dict[int, dict[int, torch.Tensor]] = {}
        self._queries: dict[int, torch.Tensor] = {}
        self._prefill = ReadStats()
        #: per batch row: the units whose next-layer blocks are being read ahead
        self._ahead: dict[int, tuple[int, list[int], PendingRead]] = {}
        self._ahead_hits = self._ahead_needed = 0
        #: per planned row: each layer's combined probe scores (their top k are the
        #: importance the reorganiser accumulates)
        self._importance: dict[int, dict[int, torch.Tensor | Callable[[], torch.Tensor] | None]] = {}
        #: per planned row: K/V blocks touched and rows selected, summed over layers
        self._touched: dict[int, list[int]] = {}
        #: ``decode="keep"`` with ``keep_reselect``: what re-selecting while decoding needs
        self.reselector = (
            Reselector(self) if reselects(store.config) and probes is not None and not store.spec.layers else None
        )

    def row_of(self, i: int) -> int:
        """The planned row that running batch row ``i`` is (repeats, beams, selections)."""
        return int(self._batch.rows[i])

    def capture(self, layer_idx: int, queries: torch.Tensor) -> None:
        """Receive ``[batch, q_heads, n, head_dim]`` post-RoPE queries of one layer."""
        self._queries[layer_idx] = queries.detach().float()

    def select(
        self, layer_idx: int, key_states: torch.Tensor, recomputed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, int]:
        """Pick and load this layer's prefix rows for every batch row: a ``[2, batch,
        kv_heads, k + new, head_dim]`` buffer whose first ``k`` rows hold them,
        right-aligned (a row with a shorter prefix leaves zeros in front, which its
        attention mask hides). With ``recomputed`` (the prefix's K/V computed after a
        damaged block), rows come from there."""
        queries = self._queries.get(layer_idx)  # kept until the layer succeeds (recovery retries it)
        mode = None
        if queries is None:  # the hooks could not capture them: keep sinks and recent rows
            if not hooks_installed(self.store.model):
                raise CacheUsageError(
                    f"no queries were captured for layer {layer_idx}; sparse prefix loading needs "
                    "ImpressCache to be used through the model's forward (generate or model(...))"
                )
            mode = "recent"
            self.stats.unscored_layers.append(layer_idx)
            queries = key_states.new_zeros(key_states.shape[0], 1, 1, 1)
        io0 = self.stats.io_wait_seconds
        probes = self.probes.layer(layer_idx) if self.probes is not None and recomputed is None else None
        bounds = self.probes.layer_summaries(layer_idx) if probes is not None and self.probes is not None else None
        t1 = time.perf_counter()
        if recomputed is not None:
            self.stats.recomputed_layers += 1
        # bounds work on small tensors: a second intra-op thread costs more than it gives
        with intra_op_threads(1 if self.store.config.block_scores == "bounds" else None):
            batch = key_states.shape[0]
            # zeros only where a row leaves some of the k rows unfilled (masked, but never garbage)
            lays = [self.layouts[self.row_of(i)] for i in range(batch)]
            buf_zeroed = any(lay is None or lay.length < self.k for lay in lays)
            buf = prefix_buffer(self.store, batch, self.k, self.room, buf_zeroed)
            sims, thresholds, fell_back = [], [], False
            for i in range(batch):
                src = self.row_of(i)
                lay = self.layouts[src]
                if lay is None:
                    continue
                mem = None if recomputed is None else self._row_from(recomputed, layer_idx, src, lay)
                # a row that fills all k rows is gathered straight into the buffer
                out = buf[:, i, :, : self.k] if lay.length >= self.k else None
                sel = self._select_row(
                    layer_idx, i, lay, queries[i], key_states[i], None if probes is None else probes[src], mem, mode,
                    None if bounds is None else bounds[src], out,
                )
                k_i = sel.keys.shape[1]
                if k_i < self.k and not buf_zeroed:  # never leave unused memory visible
                    buf[:, i, :, : self.k - k_i] = 0
                self.selections.setdefault(layer_idx, {})[i] = sel.rows
                in_place = out is not None and sel.keys.data_ptr() == out[0].data_ptr()
                if not (in_place and sel.values.data_ptr() == out[1].data_ptr()):
                    buf[0, i, :, self.k - k_i : self.k] = sel.keys
                    buf[1, i, :, self.k - k_i : self.k] = sel.values
                if mem is None:
                    self._count(sel.read)
                    self._note(layer_idx, src, lay, sel)
                if layer_idx == min(self._batch.sparse_layers):
                    self.stats.loaded_tokens += k_i
                sims.append(sel.similarity)
                thresholds.append(sel.threshold)
                fell_back |= sel.fell_back
        self.stats.layer_similarity.append(sum(sims) / max(1, len(sims)))
        self.stats.layer_threshold.append(sum(thresholds) / max(1, len(thresholds)))
        if fell_back:
            self.stats.fallback_layers.append(layer_idx)
        self.stats.select_seconds += time.perf_counter() - t1 - (self.stats.io_wait_seconds - io0)
        if self.reselector is not None and layer_idx in self._queries:
            self.reselector.question[layer_idx] = self._queries[layer_idx]
        self._queries.pop(layer_idx, None)
        if self.store.config.prefetch and recomputed is None and layer_idx + 1 in self._batch.sparse_layers:
            self._read_ahead(layer_idx + 1)
        return buf, self.k

    def reselect(self, layer_idx: int, key_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """While decoding (``keep_reselect``): choose the layer's held rows again with the
        captured queries of this step (see `Reselector`)."""
        queries = self._queries.pop(layer_idx, None)
        if queries is not None and self.reselector is not None:
            self.reselector.reselect(layer_idx, queries, key_states, keys, values)

    def _read_ahead(self, layer_idx: int) -> None:
        """Start reading, for the next layer, the blocks this layer chose (per batch row);
        with ``prefetch="agreed"`` only those the layer before chose as well."""
        agreed = self.store.config.prefetch == "agreed"
        for i, rows in self.selections.get(layer_idx - 1, {}).items():
            lay = self.layouts[self.row_of(i)]
            assert lay is not None
            units = lay.at(layer_idx - 1).units_for(rows.reshape(-1))
            before = self.selections.get(layer_idx - 2, {}).get(i) if agreed else None
            if before is not None:
                units = sorted(set(units).intersection(lay.at(layer_idx - 2).units_for(before.reshape(-1))))
            if 0 < len(units) < len(lay.at(layer_idx).units_all()):  # a layer that read everything predicts nothing
                self._ahead[i] = (layer_idx, units, self.store.start_layout(lay, KV, [layer_idx], units, known=self.memo))

    def _row_from(
        self, recomputed: list[tuple[torch.Tensor, torch.Tensor]], layer: int, row: int, lay: PrefixLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's recomputed prefix K/V (``[kv_heads, P, head_dim]``, real tokens only)."""
        k, v = recomputed[layer]
        reused = k.shape[2]
        return k[row, :, reused - lay.length :], v[row, :, reused - lay.length :]

    def _select_row(
        self,
        layer_idx: int,
        row: int,
        lay: PrefixLayout,
        queries: torch.Tensor,
        new_keys: torch.Tensor,
        probe_keys: torch.Tensor | None,
        mem: tuple[torch.Tensor, torch.Tensor] | None,
        mode: str | None = None,
        summaries: BlockSummaries | None = None,
        out: torch.Tensor | None = None,
    ) -> RowSelection:
        store, cfg = self.store, self.store.config
        mode = mode or cfg.selection
        view = lay.at(layer_idx)

        def read_units(units: Sequence[int], rows: torch.Tensor | None) -> BlockSet:
            if mem is not None:
                return view.blocks_from(mem[0], mem[1], list(units))
            return self._read_units(lay, layer_idx, row, units, rows)

        k_i = min(self.k, lay.length)
        if k_i == lay.length:
            units = view.units_all()
            blocks = read_units(units, None)
            keys, values = view.gather(units, blocks)
            return RowSelection(keys, values, 1.0, 0.0, False, torch.arange(lay.length), blocks.stats)
        if mem is not None and probe_keys is None and mode not in BASELINES:
            probe_keys = mem[0][list(store.probe.kv_heads)].float()  # exact keys: score with them
        return select_row(
            queries=queries,
            new_keys=new_keys,
            probe_keys=probe_keys,
            probe_kv_heads=store.probe.kv_heads,
            layout=view,
            k=k_i,
            read_units=read_units,
            mode=mode,
            alpha=cfg.similarity_alpha,
            fixed_threshold=cfg.similarity_threshold,
            seed=layer_idx,
            keep=(cfg.keep_sinks, cfg.keep_recent),
            block_scores=cfg.block_scores,
            summaries=summaries,
            out=out,
        )

    def _read_units(
        self, lay: PrefixLayout, layer_idx: int, row: int, units: Sequence[int], rows: torch.Tensor | None
    ) -> BlockSet:
        """Blocks of ``units`` for one layer; ``rows`` are the selected positions (they give
        each block's importance share: the fraction of its rows selected). Blocks read
        ahead for this layer are used; the ones it did not choose are accounted with
        share 0 and kept for a ``decode="full"`` read."""
        t0 = time.perf_counter()
        view = lay.at(layer_idx)
        share = [1.0] * len(lay.units)
        if rows is not None:
            counts = torch.bincount(view.unit_of[rows.reshape(-1)], minlength=len(lay.units))
            per_head = rows.shape[0] if rows.dim() == 2 else 1
            share = (counts.double() / per_head / view.unit_count.clamp(min=1)).clamp(max=1.0).tolist()
        ahead = self._ahead.pop(row, None)
        if ahead is not None and ahead[0] == layer_idx:
            _, pre_units, pending = ahead
            wanted = set(units)
            pre = pending.result([share[u] if u in wanted else 0.0 for u in pre_units])
            self._count(pre.stats)
            self._remember(lay, layer_idx, pre_units, pre)
            self._ahead_hits += len(wanted.intersection(pre_units))
            self._ahead_needed += len(units)
        blocks = self.store.start_layout(
            lay, KV, [layer_idx], units, [share[u] for u in units], known=self.memo, inline=True
        ).result()
        self._remember(lay, layer_idx, units, blocks)
        self.stats.io_wait_seconds += time.perf_counter() - t0
        return blocks

    def _remember(self, lay: PrefixLayout, layer_idx: int, units: Sequence[int], blocks: BlockSet) -> None:
        """Keep the blocks read (by `block_code`) for the decode-time read of the prefix."""
        if not self._keep_memo:
            return
        slots = blocks.pool.unbind(0)
        for code, slot in zip(lay.codes(units, layer_idx), blocks.slot_of):
            self.memo.setdefault(code, slots[slot])

    def _note(self, layer_idx: int, src: int, lay: PrefixLayout, sel: RowSelection) -> None:
        """Remember a planned row's importance and block count for this layer (once, if
        several running rows share it)."""
        per_layer = self._importance.setdefault(src, {})
        if layer_idx in per_layer:
            return
        per_layer[layer_idx] = sel.ranking  # made into [P] scores by `finish`
        rows = sel.rows.reshape(-1)
        heads = sel.rows.shape[0] if sel.rows.dim() == 2 else 1
        t = self._touched.setdefault(src, [0, 0])
        t[0] += sel.units if sel.units is not None else len(lay.at(layer_idx).units_for(rows))
        t[1] += rows.numel() // heads

    def _count(self, read: ReadStats) -> None:
        self._prefill.add(read)
        self.stats.bytes_read_rows += read.disk_bytes
        self.stats.bytes_read_disk += read.disk_bytes
        self.stats.blocks_read += read.disk_blocks

    def finish(self) -> None:
        """After the prefill: fold in the probe reads; the request's invalid-I/O ratio and
        prefetch hit rate."""
        for _, _, pending in self._ahead.values():  # read ahead for a layer that never came
            try:
                self._count(pending.result().stats)
            except CorruptBlockError:
                pass  # nothing of it is used
        self._ahead.clear()
        if self.store.config.decode != "full":
            self.memo.clear()  # only the read of the whole prefix would use them again
        if self._ahead_needed:
            self.stats.prefetch_hit_rate = self._ahead_hits / self._ahead_needed
        if self.probes is not None:
            r = self.probes.read
            self.stats.bytes_read_probe += r.disk_bytes
            self.stats.bytes_read_disk += r.disk_bytes
            self.stats.blocks_read += r.disk_blocks
        p = self._prefill
        self.stats.bytes_unattended_rows = p.kv_unattended_bytes
        self.stats.invalid_io_ratio = invalid_io_ratio(p.kv_unattended_bytes, p.kv_disk_bytes)
        layers = self.store.spec.num_layers
        for src, per_layer in self._importance.items():
            lay = self.layouts[src]
            blocks, rows = self._touched[src]
            self.stats.blocks_touched += blocks
            self.stats.rows_selected += rows
            if lay is None:
                continue
            ranks = [_rows_of(per_layer.get(layer)) for layer in range(layers)]
            imp = None
            if all(r is not None for r in ranks):  # one top-k over every layer
                imp = top_masks(torch.stack(ranks), min(self.k, lay.length)).numpy()  # type: ignore[arg-type]
            self.store.record_importance(lay.segments, imp, blocks, rows)

    def load_full(self, rows: list[int], reused: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Every prefix row of the sparse layers, for the planned batch rows ``rows`` (the
        blocks read during the prefill are reused): ``[layers, len(rows), kv_heads, reused,
        head_dim]`` keys and values (zeros in the other layers: they hold their rows
        already, a window layer only the ones it still sees), bytes and blocks read from disk."""
        spec = self.store.spec
        shape = (spec.num_layers, len(rows), spec.num_kv_heads, reused, spec.head_dim)
        keys = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        values = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        nbytes = blocks = 0
        for i, row in enumerate(rows):
            lay = self.layouts[row]
            if lay is None:
                continue
            pad = reused - lay.length
            loaded = self.store.load(
                lay.segments, out=(keys[:, i, :, pad:], values[:, i, :, pad:]), known=self.memo, decode=True,
                layers=sorted(self._batch.sparse_layers),
            )
            nbytes += loaded.bytes_read
            blocks += loaded.blocks_read
        return keys, values, nbytes, blocks
