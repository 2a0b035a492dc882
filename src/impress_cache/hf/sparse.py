"""A sparse prefill: each layer's prefix rows chosen with the new tokens' queries.

Built by `PrefixRequest` when a request loads fewer than all of its reused rows. The
probe-key copies were read when the cache was built; during the prefill the hooks hand
each layer's post-RoPE queries to `capture`, and the layer's first ``update`` calls
`select`, which picks and loads that layer's rows for every batch row (`select_row`).
Blocks read here are kept (``memo``) so that the background read of the whole prefix
for ``decode="full"`` does not read them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import probe as probe_codec
from ..errors import CacheUsageError, CorruptBlockError
from ..selection.selectors import RowSelection, select_row
from ..stats import RequestStats
from ..storage.base import KV, BlockKey
from ..store.blockset import BlockSet, ReadStats, invalid_io_ratio
from ..store.layout import PrefixLayout
from ..store.store import ImpressStore


class SparsePrefill:
    """``k`` prefix rows per layer; per batch row its layout and probe records."""

    def __init__(
        self,
        store: ImpressStore,
        k: int,
        layouts: list[PrefixLayout | None],
        probes: list[list[torch.Tensor] | None],
        stats: RequestStats,
    ) -> None:
        self.store = store
        self.k = k
        self.layouts = layouts
        self.probes = probes
        self.stats = stats
        self.repeats = 1
        #: blocks this request has read, by key (the decode-time read skips them)
        self.memo: dict[BlockKey, torch.Tensor] = {}
        #: ``selections[layer][batch_row]``: prefix positions attended (relative to the
        #: row's first real token; ``[k]`` shared or ``[kv_heads, k]``)
        self.selections: dict[int, dict[int, torch.Tensor]] = {}
        self._queries: dict[int, torch.Tensor] = {}
        self._prefill = ReadStats()

    def row_of(self, i: int) -> int:
        """Original batch row of (possibly expanded) row ``i``."""
        return i // self.repeats

    def capture(self, layer_idx: int, queries: torch.Tensor) -> None:
        """Receive ``[batch, q_heads, n, head_dim]`` post-RoPE queries of one layer."""
        self._queries[layer_idx] = queries.detach().float()

    def select(self, layer_idx: int, key_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick and load this layer's prefix rows for every batch row: ``[batch, kv_heads,
        k, head_dim]`` keys and values, right-aligned (a row with a shorter prefix leaves
        zeros in front, which its attention mask hides)."""
        queries = self._queries.pop(layer_idx, None)
        if queries is None:
            raise CacheUsageError(
                f"no queries were captured for layer {layer_idx}; sparse prefix loading needs "
                "ImpressCache to be used through the model's forward (generate or model(...))"
            )
        store, spec = self.store, self.store.spec
        batch = key_states.shape[0]
        shape = (batch, spec.num_kv_heads, self.k, spec.head_dim)
        pk = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        pv = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        sims, thresholds, fell_back = [], [], False
        for i in range(batch):
            lay = self.layouts[self.row_of(i)]
            if lay is None:
                continue
            try:
                sel = self._select_row(layer_idx, i, lay, queries[i], key_states[i])
            except CorruptBlockError as exc:
                store.quarantine(exc.file_id, str(exc))
                self.stats.quarantined_files += 1
                raise CorruptBlockError(
                    f"{exc}. The file was quarantined; this request cannot recompute those tokens any more. "
                    "Retry the request: it will recompute them.",
                    exc.file_id,
                ) from exc
            k_i = sel.keys.shape[1]
            self.selections.setdefault(layer_idx, {})[i] = sel.rows
            pk[i, :, self.k - k_i :] = sel.keys
            pv[i, :, self.k - k_i :] = sel.values
            self._count(sel.read)
            if layer_idx == 0:
                self.stats.loaded_tokens += k_i
            sims.append(sel.similarity)
            thresholds.append(sel.threshold)
            fell_back |= sel.fell_back
        self.stats.layer_similarity.append(sum(sims) / max(1, len(sims)))
        self.stats.layer_threshold.append(sum(thresholds) / max(1, len(thresholds)))
        if fell_back:
            self.stats.fallback_layers.append(layer_idx)
        return pk, pv

    def _select_row(
        self, layer_idx: int, i: int, lay: PrefixLayout, queries: torch.Tensor, new_keys: torch.Tensor
    ) -> RowSelection:
        store, spec, cfg = self.store, self.store.spec, self.store.config

        def read_units(units: Sequence[int], rows: torch.Tensor | None) -> BlockSet:
            return self._read_units(lay, layer_idx, units, rows)

        k_i = min(self.k, lay.length)
        if k_i == lay.length:
            units = list(range(len(lay.units)))
            blocks = read_units(units, None)
            keys, values = lay.gather(units, blocks)
            return RowSelection(keys, values, 1.0, 0.0, False, torch.arange(lay.length), blocks.stats)
        raw = self.probes[self.row_of(i)]
        probe_keys = (
            None
            if raw is None
            else probe_codec.decode(raw[layer_idx], len(store.probe.kv_heads), spec.head_dim, store.probe.encoding)
        )
        return select_row(
            queries=queries,
            new_keys=new_keys,
            probe_keys=probe_keys,
            probe_kv_heads=store.probe.kv_heads,
            layout=lay,
            k=k_i,
            read_units=read_units,
            mode=cfg.selection,
            alpha=cfg.similarity_alpha,
            fixed_threshold=cfg.similarity_threshold,
            seed=layer_idx,
        )

    def _read_units(self, lay: PrefixLayout, layer_idx: int, units: Sequence[int], rows: torch.Tensor | None) -> BlockSet:
        """Blocks of ``units`` for one layer; ``rows`` are the selected positions (they give
        each block's importance share: the fraction of its rows selected)."""
        keys = lay.keys(units, KV, layer_idx)
        shares: list[float | None] | None = None
        if rows is not None:
            counts = torch.bincount(lay.unit_of[rows.reshape(-1)], minlength=len(lay.units))
            per_head = rows.shape[0] if rows.dim() == 2 else 1
            idx = torch.as_tensor(list(units), dtype=torch.long)
            shares = (counts[idx].double() / per_head / lay.unit_count[idx]).clamp(max=1.0).tolist()
        blocks = self.store.read_blocks(keys, shares, known=self.memo)
        for i, key in enumerate(keys):
            self.memo.setdefault(key, blocks.block(i))
        return blocks

    def _count(self, read: ReadStats) -> None:
        self._prefill.add(read)
        self.stats.bytes_read_rows += read.disk_bytes
        self.stats.bytes_read_disk += read.disk_bytes
        self.stats.blocks_read += read.disk_blocks

    def finish(self) -> None:
        """After the prefill: the request's invalid-I/O ratio."""
        p = self._prefill
        self.stats.bytes_unattended_rows = p.kv_unattended_bytes
        self.stats.invalid_io_ratio = invalid_io_ratio(p.kv_unattended_bytes, p.kv_disk_bytes)

    def load_full(self, batch: int, reused: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Every prefix row of every batch row (the blocks read during the prefill are
        reused): ``[layers, batch, kv_heads, reused, head_dim]`` keys and values, bytes
        and blocks read from disk."""
        spec = self.store.spec
        shape = (spec.num_layers, batch, spec.num_kv_heads, reused, spec.head_dim)
        keys = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        values = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        nbytes = blocks = 0
        for i in range(batch):
            lay = self.layouts[self.row_of(i)]
            if lay is None:
                continue
            pad = reused - lay.length
            loaded = self.store.load(
                lay.segments, out=(keys[:, i, :, pad:], values[:, i, :, pad:]), known=self.memo, decode=True
            )
            nbytes += loaded.bytes_read
            blocks += loaded.blocks_read
        return keys, values, nbytes, blocks
