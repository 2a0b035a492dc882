"""Re-selection while decoding with ``decode="keep"`` (``keep_reselect``).

A sparse prefill chooses each layer's ``k`` prefix rows with the new tokens' queries, and
with ``decode="keep"`` every later token attends to those rows only. The tokens of the
answer often need other parts of the prefix than the question did. Every
``keep_reselect`` generated tokens, `Reselector.reselect` chooses each layer's rows again
with the latest token's queries (the prefill's scoring over the probe copies, kept
encoded in memory; per KV head and per row where the probe copy holds every KV head,
else one shared set of rows), reads only the blocks the layer does not hold yet and writes the new rows
over the held ones: a layer never holds more than ``k`` prefix rows.

Held rows stay right-aligned in the layer's ``[batch, kv_heads, k + ..., head_dim]``
keys (a batch row with a shorter prefix has masked zeros in front), and keys are stored
after RoPE, so replacing rows needs no change of positions or masks.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from ..config import ImpressConfig
from ..errors import CorruptBlockError, StoreFormatError, StoreIOError
from ..selection.modes import BASELINES
from ..selection.scores import topk_indices, vote
from ..selection.selectors import kept_rows, probe_scores
from ..storage.base import KV
from ..store.layout import LayerView, PrefixLayout
from .refresh import recompute_new_tokens

if TYPE_CHECKING:
    from .sparse import SparsePrefill

log = logging.getLogger(__name__)


def reselects(config: ImpressConfig) -> bool:
    """Whether sparse requests under ``config`` re-select while decoding."""
    return config.decode == "keep" and config.keep_reselect > 0 and config.selection not in BASELINES


class Reselector:
    """The held positions of a ``keep_reselect`` request (the probe loader keeps the
    encoded probe rows, decoded again at every re-selection)."""

    def __init__(self, sparse: SparsePrefill) -> None:
        self._sparse = sparse
        #: per layer, per running row: the positions held (``[k]`` or ``[kv_heads, k]``)
        self._held: dict[int, dict[int, torch.Tensor]] = {}
        #: per layer: the new tokens' queries of the prefill (for `refresh`)
        self.question: dict[int, torch.Tensor] = {}
        #: a read failed: the request keeps the rows it holds from then on
        self.failed = False
        #: per layer, per running row: the decayed sum of past probe scores (``keep_reselect_decay``)
        self._ranked: dict[int, dict[int, torch.Tensor]] = {}

    def refresh(self, layers: list[Any], model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, reused: int) -> None:
        """Before the first decode step: every layer's rows chosen again with the new
        tokens' queries (per token and KV head, see `reselect`), then the new tokens' K/V
        computed again over the rows now held. The prefill chose whole blocks for every
        head; this gives the K/V every later token attends to the finer choice."""
        sp = self._sparse
        k = sp.k
        if self.question.keys() != set(range(len(layers))):
            return
        for li, layer in enumerate(layers):
            self.reselect(li, self.question.pop(li), layer.keys[:, :, k:], layer.keys, layer.values)
        if not sp.store.config.refresh_new_tokens:
            return
        held = torch.zeros(layers[0].keys.shape[0], k, dtype=torch.long)
        for i in range(held.shape[0]):
            lay = sp.layouts[sp.row_of(i)]
            if lay is not None:
                held[i, k - min(k, lay.length) :] = 1
        t0 = time.perf_counter()
        prefix = [(la.keys[:, :, :k], la.values[:, :, :k]) for la in layers]
        new, _ = recompute_new_tokens(model, ids, mask, reused, prefix, layers[0].keys.dtype, held)
        for la, (nk, nv) in zip(layers, new.values()):
            la.keys[:, :, k : k + nk.shape[2]] = nk
            la.values[:, :, k : k + nv.shape[2]] = nv
        sp.stats.refreshed_tokens += int(mask[:, reused:].sum())
        sp.stats.refresh_seconds += time.perf_counter() - t0

    def rows_changed(self, indices: torch.Tensor) -> None:
        """Running row ``j`` is now former row ``indices[j]``."""
        idx = indices.tolist()
        for layer, chosen in self._sparse.selections.items():  # the prefill's rows, where not chosen again
            held = self._held.setdefault(layer, {})
            for i, rows in chosen.items():
                held.setdefault(i, rows)
        for per_row in (self._held, self._ranked):
            for layer, rows in per_row.items():
                per_row[layer] = {j: rows[i] for j, i in enumerate(idx) if i in rows}
        for layer, q in self.question.items():
            self.question[layer] = q.index_select(0, indices.to(q.device))

    def held(self, layer_idx: int, i: int) -> torch.Tensor | None:
        """The positions running row ``i`` holds in layer ``layer_idx``."""
        got = self._held.get(layer_idx, {}).get(i)
        if got is None:  # not chosen again yet: the prefill's rows (`rows_changed` copies them)
            got = self._sparse.selections.get(layer_idx, {}).get(i)
        return got

    def reselect(self, layer_idx: int, queries: torch.Tensor, key_states: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor) -> None:
        """Choose layer ``layer_idx``'s prefix rows again for every running row, with
        ``queries`` ``[batch, q_heads, n, head_dim]`` and the new ``key_states``; the held
        rows ``keys[:, :, :k]`` / ``values[:, :, :k]`` are replaced in place."""
        sp = self._sparse
        stats = sp.stats
        loader = sp.probes
        probes = None if loader is None or loader.raw is None else loader.raw.get(layer_idx)
        if probes is None:
            return
        t0 = time.perf_counter()
        k = sp.k
        # one token's rows per KV head where the probe copy holds every KV head (their
        # scores are known), else one shared set: never a whole-layer read per step
        every_head = list(sp.store.probe.kv_heads) == list(range(sp.store.spec.num_kv_heads))
        done = 0
        for i in range(keys.shape[0]):
            src = sp.row_of(i)
            lay = sp.layouts[src]
            prev = self.held(layer_idx, i)
            raw = probes[src]
            if self.failed or lay is None or prev is None or raw is None or min(k, lay.length) == lay.length:
                continue
            try:
                rows = self._row(layer_idx, i, lay, min(k, lay.length), queries[i], key_states[i], loader.decode(raw),
                                 prev, keys[i], values[i], every_head)
            except (CorruptBlockError, StoreIOError, StoreFormatError) as exc:
                # the rows held are still the stored K/V of their positions: keep them
                self.failed = True
                log.warning("re-selection stopped for this request, keeping the rows held: %s", exc)
                if isinstance(exc, CorruptBlockError):
                    try:
                        sp.store.quarantine(exc.file_id, str(exc))
                    except (StoreFormatError, StoreIOError) as err:
                        log.warning("could not quarantine file %s: %s", exc.file_id, err)
                continue
            self._held.setdefault(layer_idx, {})[i] = rows
            done += 1
        if done:
            stats.reselections += 1
            stats.reselect_seconds += time.perf_counter() - t0

    def _row(self, layer_idx: int, i: int, lay: PrefixLayout, k_i: int, queries: torch.Tensor, new_keys: torch.Tensor,
             probe_keys: torch.Tensor, prev: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             every_head: bool) -> torch.Tensor:
        """One batch row: score, read what is not held, write the new rows over the held
        ones (``keys``/``values`` are the row's ``[kv_heads, k + ..., head_dim]``; nothing is
        written if a read fails). Returns the positions now held."""
        sp = self._sparse
        cfg, k, dev = sp.store.config, sp.k, keys.device
        view = lay.at(layer_idx)
        h, d = keys.shape[0], keys.shape[-1]
        # per head, where each position is held (its slot among the held rows, -1: not held)
        held_at = (prev.expand(h, -1) if prev.dim() == 1 else prev).to(dev)
        slot_of = torch.full((h, lay.length), -1, dtype=torch.long, device=dev)
        slot_of.scatter_(1, held_at, torch.arange(k_i, device=dev).expand(h, -1))
        scores = probe_scores(queries, new_keys, probe_keys, sp.store.probe.kv_heads)
        if cfg.keep_reselect_decay > 0:  # this token's share of attention, plus the past's, decayed
            scores = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            past = self._ranked.get(layer_idx, {}).get(i)
            if past is not None:
                scores = scores + cfg.keep_reselect_decay * past
            self._ranked.setdefault(layer_idx, {})[i] = scores
        forced = kept_rows(lay.length, cfg.keep_sinks, cfg.keep_recent)
        if forced is not None:
            scores[:, forced] += 1e9  # above every scored row, as in the prefill
        rows = (topk_indices if every_head else vote)(scores.unsqueeze(0), k_i)[0]
        at = (rows.expand(h, -1) if rows.dim() == 1 else rows).to(dev)
        slot = slot_of.gather(1, at)  # [h, k_i]
        take = slot.clamp(min=0).unsqueeze(-1).expand(-1, -1, d)
        new_k = keys[:, k - k_i : k].gather(1, take)
        new_v = values[:, k - k_i : k].gather(1, take)
        absent = slot < 0
        if bool(absent.any()):
            mk, mv = _read_missing(sp, lay, view, layer_idx, at, absent)
            miss = absent.unsqueeze(-1)
            new_k = torch.where(miss, mk.to(dev, keys.dtype), new_k)
            new_v = torch.where(miss, mv.to(dev, values.dtype), new_v)
        keys[:, k - k_i : k] = new_k
        values[:, k - k_i : k] = new_v
        return rows

def _read_missing(sp: SparsePrefill, lay: PrefixLayout, view: LayerView, layer_idx: int, at: torch.Tensor,
                  absent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the blocks holding the positions ``at[absent]`` (``at``: ``[kv_heads, k]``)
    and return ``[kv_heads, k, head_dim]`` keys and values, those of ``at`` where
    ``absent`` (elsewhere a row of the blocks read: the caller keeps its held rows)."""
    wanted = at[absent]
    missing = view.units_for(torch.unique(wanted).cpu())
    # mostly blocks read earlier in this request (page cache): read in this thread
    blocks = sp.store.start_layout(lay, KV, [layer_idx], missing, decode=True, inline=True).result()
    stats = sp.stats
    stats.bytes_read_decode += blocks.stats.disk_bytes
    stats.bytes_read_disk += blocks.stats.disk_bytes
    stats.blocks_read += blocks.stats.disk_blocks
    return view.gather(missing, blocks, torch.where(absent, at, wanted[0]).cpu())
