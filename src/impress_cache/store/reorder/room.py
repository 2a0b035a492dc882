"""The store's reordering room: importance statistics in, rewritten nodes out.

`ImpressStore` builds one `Reordering` and hands it what the sparse prefills report
(`record`); the reorganiser runs in the background once the store is idle, on
`ImpressStore.reorganize` and with ``impress-cache reorg``. This module wires the
reorganiser to the rest of the store: it reads a node's rows with quiet reads (no memory
tiers, no counters), and after a rewrite it moves the node's statistics to its
replacement, unlinks the files nobody references (once no lease holds them) and seeds
the memory tiers' statistics of the new blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import ImpressConfig
from ...index.radix import RadixNode, Segment
from ...index.sqlite import FileRecord
from ...model_info import ModelSpec
from ...storage.base import KV
from ...tiers import TierManager
from ..activity import Activity
from ..blocks import BlockIO
from ..catalog import Catalog
from ..layout import PrefixLayout
from ..leases import LeaseTable
from ..values import NodeValues
from ..writer import PromptWriter
from .importance import ImportanceStats
from .reorganizer import Reorganizer, block_shares


class Reordering:
    """Importance statistics, the reorganiser and the per-request block counts."""

    def __init__(
        self,
        root: Path,
        catalog: Catalog,
        io: BlockIO,
        writer: PromptWriter,
        leases: LeaseTable,
        values: NodeValues,
        tiers: TierManager,
        activity: Activity,
        importance: ImportanceStats,
        spec: ModelSpec,
        config: ImpressConfig,
    ) -> None:
        self._catalog = catalog
        self._io = io
        self._leases = leases
        self._values = values
        self._tiers = tiers
        self._spec = spec
        self._config = config
        self.importance = importance
        idle = config.reorg_idle_ms
        self.reorganizer = Reorganizer(
            root, catalog, self.importance, activity, self._read_node, writer.write_rows, self._replaced,
            layers=spec.num_layers, chunk_tokens=config.chunk_tokens, important_ratio=config.sparse_ratio,
            idle_s=(50.0 if idle is None else float(idle)) / 1000.0,
            min_requests=config.reorg_min_requests, min_gain=config.reorg_min_gain,
        )
        #: sparse requests recorded, blocks they touched and rows they selected (all layers)
        self.requests = 0
        self.blocks_touched = 0
        self.rows_selected = 0

    # -- statistics in ----------------------------------------------------------------------
    def record(self, segments: Sequence[Segment], importance: np.ndarray | None, blocks: int, rows: int) -> None:
        """One sparse request's ``[layers, positions]`` importance over its matched
        ``segments`` (``None``: not known) and the blocks it touched for the rows it
        selected (summed over layers)."""
        self.requests += 1
        self.blocks_touched += blocks
        self.rows_selected += rows
        if importance is None:
            return
        with self._catalog.lock:
            # statistics only for nodes still in the tree as matched (not split or rewritten)
            live = all(self._catalog.tree.get(seg.node.id) is seg.node for seg in segments)
        if live:
            self.importance.add(segments, importance)
            self.reorganizer.wake()

    def run(self, force: bool, limit: int | None, progress: bool) -> dict[str, Any]:
        """`ImpressStore.reorganize`: the reorganiser's run now, with a progress bar; it
        returns once the files it replaced (and no request holds) are deleted."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc="reordering", unit="node")
        try:
            return self.reorganizer.run(force, limit, None if bar is None else bar.update)
        finally:
            if bar is not None:
                bar.close()
            self._leases.unlinker.drain()

    def stats(self) -> dict[str, Any]:
        c = self.reorganizer.counters
        return {
            "reorganisations": c.reorganisations,
            "bytes_rewritten": c.bytes_rewritten,
            "reorg_bytes_read": c.bytes_read,
            "reorg_seconds": c.rewrite_seconds,
            "reorgs_abandoned": c.abandoned,
            "sparse_requests": self.requests,
            "blocks_per_selected_row": self.blocks_touched / self.rows_selected if self.rows_selected else 0.0,
        }

    def reset_stats(self) -> None:
        self.reorganizer.counters = type(self.reorganizer.counters)()
        self.requests = self.blocks_touched = self.rows_selected = 0

    # -- the reorganiser's callbacks -------------------------------------------------------
    def _read_node(
        self, node: RadixNode, between: Callable[[], None]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Every row of ``node``, layer by layer, in prompt order (its file held by a lease
        that does not count as a request)."""
        lay = PrefixLayout([Segment(node, node.length)], self._catalog.chunk_tokens_of, self._catalog.perm_of)
        ks, vs, nbytes = [], [], 0
        with self._leases.hold([node.file_id], request=False):
            for layer in range(self._spec.num_layers):
                between()
                view = lay.at(layer)
                units = view.units_all()
                blocks = self._io.start_layout(lay, KV, [layer], units, quiet=True).result()
                k, v = view.gather(units, blocks)
                ks.append(k)
                vs.append(v)
                nbytes += blocks.stats.disk_bytes
        return ks, vs, nbytes

    def _replaced(
        self, old: RadixNode, new: RadixNode | None, file_id: int, dropped: list[FileRecord], order: np.ndarray
    ) -> None:
        catalog = self._catalog
        for rec in dropped:
            # a request that leased the old node may be reading the old file: this
            # process closes its descriptor only when the last lease goes, then unlinks
            forget = functools.partial(catalog.forget, (rec.id,), (rec,))
            self._leases.defer_unlink(rec.id, rec.name, before=forget)
        if new is None:  # the tree did not follow the commit yet (`Catalog.replace_node`)
            return
        # (its statistics moved to ``new`` when the tree followed the commit: `Catalog._follow`)
        self.importance.settle(new.id)
        if self._tiers.enabled:
            shares = block_shares(order, self._config.sparse_ratio, self._config.chunk_tokens)
            for layer in range(shares.shape[0]):
                for b in range(shares.shape[1]):
                    self._tiers.seed((file_id, KV, layer, b), float(shares[layer, b]))
