"""Reading a request's prefix layer by layer while the model computes.

`DenseLoader` reads every prefix row of every layer (dense reuse) on a background
thread: it keeps the disk reads of the next ``window`` layers in flight and gathers each
layer's rows into a buffer that also has room for the new tokens' K/V, so the layer's
first ``update`` copies nothing but the new rows. `ProbeLoader` does the same for the
probe-key copies of a sparse prefill (read and decoded ahead of the layers that score
with them). The model waits for a layer only if its rows are not there yet; that wait is
what ``RequestStats.io_wait_seconds`` (and ``probe_seconds``) report.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import probe as probe_codec
from ..selection.bounds import BlockSummaries, block_summaries
from ..stats import RequestStats
from ..storage.base import KV, PROBE
from ..store.blockset import ReadStats
from ..store.direct import RowsRead
from ..store.layout import PrefixLayout
from ..store.store import ImpressStore

#: layers whose reads are in flight ahead of the one being gathered
WINDOW = 4


class _Background:
    """A per-layer product computed in order on a loader thread."""

    def __init__(self, store: ImpressStore, layers: int, produce: Callable[[int], Any], prepare: Callable[[int], Any]) -> None:
        self._ready = [threading.Event() for _ in range(layers)]
        self._items: list[Any] = [None] * layers
        self._error: BaseException | None = None
        self._produce = produce
        self._prepare = prepare
        self._cancelled = False
        #: when the loader started and produced its last layer (``None``: not yet, or failed)
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.future = store.loader.submit(self._run, layers)

    def _run(self, layers: int) -> None:
        started: deque[Any] = deque()
        nxt = 0
        try:
            for layer in range(layers):
                while nxt < layers and nxt < layer + WINDOW:
                    started.append(self._prepare(nxt))
                    nxt += 1
                if self._cancelled:
                    return
                self._items[layer] = self._produce(started.popleft())
                self._ready[layer].set()
            self.finished = time.perf_counter()
        except BaseException as exc:  # handed to the layer that waits
            self._error = exc
        finally:
            for ev in self._ready:
                ev.set()

    def get(self, layer: int) -> tuple[Any, float]:
        """The product for ``layer`` and the seconds spent waiting for it."""
        t0 = time.perf_counter()
        self._ready[layer].wait()
        waited = time.perf_counter() - t0
        item = self._items[layer]
        if item is None and self._error is not None:
            raise self._error
        self._items[layer] = None  # the layer owns it now
        return item, waited

    def cancel(self) -> None:
        self._cancelled = True


def prefix_buffer(store: ImpressStore, batch: int, rows: int, room: int, zero: bool) -> torch.Tensor:
    """``[2, batch, kv_heads, rows + room, head_dim]`` in the stored dtype."""
    spec = store.spec
    shape = (2, batch, spec.num_kv_heads, rows + room, spec.head_dim)
    return (torch.zeros if zero else torch.empty)(shape, dtype=spec.torch_kv_dtype)


#: one batch row's read of one layer: its layer view, the units read and the pending read
_RowRead = tuple[Any, list[int], Any]


def _start_reads(
    store: ImpressStore, layouts: list[PrefixLayout | None], kind: int, layer: int, place_hits: bool = True,
    positions: list[torch.Tensor | None] | None = None,
) -> tuple[int, list[_RowRead | None]]:
    """Start reading ``layer``'s blocks of ``kind`` for every batch row (``None``: a row
    without a stored prefix), of the units holding ``positions[row]`` (default: all);
    the units are computed once, for the read and the gather."""
    reads: list[_RowRead | None] = []
    for i, lay in enumerate(layouts):
        pos = None if positions is None else positions[i]
        if lay is None or (pos is not None and len(pos) == 0):
            reads.append(None)
            continue
        view = lay.at(layer)
        units = view.units_all() if pos is None else view.units_for(pos)
        reads.append((view, units, store.start_layout(lay, kind, [layer], units, place_hits=place_hits)))
    return layer, reads


class DenseLoader:
    """Prefix rows of every layer, gathered into per-layer buffers in the background.

    ``held[layer]`` is how many of the last prefix rows the layer holds (every row, or
    what a window still sees); ``None`` skips the layer (a sparse prefill chooses its
    rows). Default: every row of every layer. Beside a sparse prefill (some layer
    skipped) its reads count as ``bytes_read_rows`` too: K/V read for the prefill.
    """

    def __init__(
        self,
        store: ImpressStore,
        layouts: list[PrefixLayout | None],
        pads: list[int],
        reused: int,
        room: int,
        stats: RequestStats,
        held: list[int | None] | None = None,
    ) -> None:
        self._store = store
        self._layouts = layouts
        self._pads = pads
        self._reused = reused
        self._held = held if held is not None else [reused] * store.spec.num_layers
        self._beside_sparse = any(h is None for h in self._held)
        self._room = room
        self._stats = stats
        self._lock = threading.Lock()
        #: bytes read from disk (the cost model's bandwidth sample, with `seconds`)
        self.disk_bytes = 0
        self._bg = _Background(store, store.spec.num_layers, self._gather, self._start)

    @property
    def seconds(self) -> float | None:
        """Wall time from the loader's start to its last layer (``None``: not done)."""
        return None if self._bg.finished is None else self._bg.finished - self._bg.started

    def _positions(self, layer: int) -> list[torch.Tensor | None] | None:
        """Per batch row, the stored positions the layer holds (``None``: all of them)."""
        held = self._held[layer]
        if held is None or held == self._reused:
            return None
        first = self._reused - held
        return [torch.arange(max(first, pad), self._reused) - pad for pad in self._pads]

    def _start(self, layer: int) -> tuple[int, list[_RowRead | list[torch.Tensor] | RowsRead | None], torch.Tensor] | None:
        held = self._held[layer]
        if held is None:
            return None
        positions = self._positions(layer)
        buf = prefix_buffer(self._store, len(self._layouts), held, self._room, max(self._pads) > self._reused - held)
        resident: list[list[torch.Tensor] | RowsRead | None] = [None] * len(self._layouts)
        if positions is None:  # rows held in the memory tiers' slabs: views, no read
            resident = [None if lay is None else self._store.resident_rows(lay, layer) for lay in self._layouts]
            for i, lay in enumerate(self._layouts):  # else, with the tiers off: read straight into the buffer
                if lay is not None and resident[i] is None:
                    resident[i] = self._store.start_rows(lay, layer, buf[:, i, :, self._pads[i] : self._reused])
        todo = [None if r is not None else lay for lay, r in zip(self._layouts, resident)]
        _, reads = _start_reads(self._store, todo, KV, layer, place_hits=False, positions=positions)
        return layer, [r if r is not None else read for r, read in zip(resident, reads)], buf

    def _gather(self, started: tuple[int, list[_RowRead | list[torch.Tensor] | RowsRead | None], torch.Tensor] | None) -> torch.Tensor | None:
        if started is None:
            return None
        layer, reads, buf = started
        held = self._held[layer]
        assert held is not None
        positions = self._positions(layer)
        for i, row in enumerate(reads):
            if row is None:
                continue
            if isinstance(row, RowsRead):  # read, verified and placed by the reader threads
                self._count(row.result())
                continue
            if isinstance(row, list):  # slab views: one copy each
                at = self._pads[i]
                for part in row:
                    buf[:, i, :, at : at + part.shape[2]].copy_(part)
                    at += part.shape[2]
                continue
            view, units, read = row
            blocks = read.result()
            if positions is None:
                view.gather_into(units, blocks, buf[:, i, :, self._pads[i] : self._reused])
            else:
                k, v = view.gather(units, blocks, positions[i])
                start = held - len(positions[i])
                buf[0, i, :, start:held] = k
                buf[1, i, :, start:held] = v
            self._count(blocks.stats)
        return buf

    def _count(self, read: ReadStats) -> None:
        with self._lock:
            self._stats.bytes_read_disk += read.disk_bytes
            self.disk_bytes += read.disk_bytes
            if self._beside_sparse:
                self._stats.bytes_read_rows += read.disk_bytes
            self._stats.blocks_read += read.disk_blocks

    def layer(self, layer: int) -> torch.Tensor:
        """The layer's buffer (``[2, batch, kv_heads, held + room, head_dim]``, its last
        ``held`` prefix rows filled); raises the error of a failed read."""
        buf, waited = self._bg.get(layer)
        self._stats.io_wait_seconds += waited
        return buf

    def cancel(self) -> None:
        self._bg.cancel()


class ProbeLoader:
    """Decoded probe keys of every batch row, layer by layer in the background."""

    def __init__(
        self,
        store: ImpressStore,
        layouts: list[PrefixLayout | None],
        stats: RequestStats,
        keep_raw: bool = False,
        layers: Iterable[int] | None = None,
    ) -> None:
        self._store = store
        #: the layers whose probes are read (default: every layer); a layer that holds
        #: its rows without choosing (a window layer) never scores them
        self._layers = None if layers is None else frozenset(layers)
        self._layouts = layouts
        self._stats = stats
        #: what the probe reads cost (kept apart: the loader thread is the only writer)
        self.read = ReadStats()
        #: with ``keep_raw``: per layer, per batch row, the encoded probe rows (``decode``
        #: turns them into keys again; a fraction of the decoded keys' memory)
        self.raw: dict[int, list[torch.Tensor | None]] | None = {} if keep_raw else None
        #: with ``block_scores="bounds"``: per layer, per batch row, the units' key bounds,
        #: computed here with the decoded keys (off the layers' path); taken by the layer
        self.summaries: dict[int, list[BlockSummaries | None]] | None = (
            {} if store.config.block_scores == "bounds" and store.config.selection in ("block", "token") else None
        )
        self._bg = _Background(store, store.spec.num_layers, self._decode, self._start)

    def _start(self, layer: int) -> tuple[int, list[_RowRead | None]]:
        if self._layers is not None and layer not in self._layers:
            return layer, [None] * len(self._layouts)
        return _start_reads(self._store, self._layouts, PROBE, layer)

    def _decode(self, started: tuple[int, list[_RowRead | None]]) -> list[torch.Tensor | None]:
        layer, reads = started
        out: list[torch.Tensor | None] = []
        raws: list[torch.Tensor | None] = []
        bounds: list[BlockSummaries | None] = []
        for row in reads:
            if row is None:
                out.append(None)
                raws.append(None)
                bounds.append(None)
                continue
            view, units, read = row
            blocks = read.result()
            raw = view.gather_rows(units, blocks)
            raws.append(raw)
            keys = self.decode(raw)
            out.append(keys)
            summ = None
            if self.summaries is not None:
                summ = block_summaries(keys, *view.unit_table())
                summ.stacked, summ.all_present  # made here, off the layers' path  # noqa: B018
            bounds.append(summ)
            self.read.add(blocks.stats)
        if self.raw is not None:
            self.raw[layer] = raws
        if self.summaries is not None:
            self.summaries[layer] = bounds
        return out

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """``[probed kv heads, P, head_dim]`` float32 keys of encoded probe rows."""
        store = self._store
        return probe_codec.decode(raw, len(store.probe.kv_heads), store.spec.head_dim, store.probe.encoding)

    def layer(self, layer: int) -> list[torch.Tensor | None]:
        """Per batch row, ``[probed kv heads, P, head_dim]`` float32 probe keys."""
        keys, waited = self._bg.get(layer)
        self._stats.probe_seconds += waited
        return keys

    def layer_summaries(self, layer: int) -> list[BlockSummaries | None] | None:
        """Per batch row, the key bounds of ``layer``'s units (after `layer`; ``None``
        unless ``block_scores="bounds"``). The layer owns them afterwards."""
        return None if self.summaries is None else self.summaries.pop(layer, None)

    def cancel(self) -> None:
        self._bg.cancel()
