"""ImpressCache: one request's view of an `ImpressStore`.

This module is the only one that knows how ``transformers`` drives a cache:

* ``generate`` computes only ``input_ids.shape[1] - cache.get_seq_length()`` tokens, so
  before the first forward every layer reports the reused prefix length;
* on its first ``update`` a layer puts the stored prefix rows in front of the new ones;
* once the last layer has seen the whole prompt, the prompt's K/V go to the store's
  background writer;
* a forward pre-hook on the model checks that the tokens ``generate`` runs are the ones
  the cache was built for, so stale K/V is never served.

Left padding: each row reuses the same number of columns ``C`` (the cache holds one
sequence length), ``C = min_i(pad_i + match_i)``; padding columns hold zeros, which the
attention mask hides.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import probe as probe_codec
from .errors import CacheUsageError, CorruptBlockError
from .layout import PrefixLayout
from .radix import Match, Segment
from .sparse import BASELINES, gather_all, select_row
from .stats import RequestStats, RowStats
from .storage.base import KV
from .store import BlockKey, ImpressStore, PrefixLease

log = logging.getLogger(__name__)

_MAX_QUARANTINE_RETRIES = 8


@dataclass
class _SparsePlan:
    """What a sparse prefill needs: ``k`` rows per layer, each row's layout and probe keys."""

    k: int
    layouts: list[PrefixLayout | None]
    probes: list[list[torch.Tensor] | None]
    repeats: int = 1

    def row_of(self, i: int) -> int:
        """Original batch row of (possibly expanded) row ``i``."""
        return i // self.repeats



class ImpressLayer(DynamicLayer):
    """A dynamic cache layer that starts with stored prefix rows."""

    def __init__(
        self,
        prefix_keys: torch.Tensor | None,
        prefix_values: torch.Tensor | None,
        prefix_len: int,
        hidden: int = 0,
    ) -> None:
        super().__init__()
        self._prefix: tuple[torch.Tensor, torch.Tensor] | None = (
            (prefix_keys, prefix_values) if prefix_keys is not None and prefix_len > 0 else None
        )
        self._prefix_len = prefix_len
        #: prefix rows that are not held (sparse prefill): key index j is position j + hidden
        self.hidden = hidden

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self._prefix is not None:
            k, v = self._prefix
            self.keys = k.to(self.device, self.dtype)
            self.values = v.to(self.device, self.dtype)
        self._prefix = None

    def get_seq_length(self) -> int:
        """Logical length: prefix plus everything after it, held or not."""
        if not self.is_initialized:
            return self._prefix_len
        return super().get_seq_length() + self.hidden

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() - self.hidden + query_length, self.hidden

    def restore_prefix(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the held prefix rows by the whole prefix (``decode="full"``)."""
        held = self._prefix_len - self.hidden
        self.keys = torch.cat([keys.to(self.device, self.dtype), self.keys[:, :, held:]], dim=-2)
        self.values = torch.cat([values.to(self.device, self.dtype), self.values[:, :, held:]], dim=-2)
        self.hidden = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.get_seq_length() + tokens_to_remove < self._prefix_len:
            raise CacheUsageError("crop() would cut into the reused prefix; ImpressCache does not support that")
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._prefix is not None:
            k, v = self._prefix
            self._prefix = (k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0))
        if self.is_initialized:
            super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._prefix is not None:
            k, v = self._prefix
            self._prefix = (k[indices], v[indices])
        if self.is_initialized:
            super().batch_select_indices(indices)


class ImpressCache(Cache):
    """A ``transformers`` cache that reuses the longest stored prefix of each prompt.

    Parameters
    ----------
    store:
        The `ImpressStore` to read from and write to.
    input_ids:
        The full prompt, ``[batch, seq]`` integer tensor, exactly as passed to
        ``generate``. Each row reuses at most ``seq - 1`` stored tokens.
    attention_mask:
        The mask passed to ``generate`` (left padding only). Required when the batch
        is padded.
    store_prompt:
        Write the prompt's K/V to the store once it has been computed.

    Notes
    -----
    One cache serves one request: build a new one for every ``generate`` call.
    """

    def __init__(
        self,
        store: ImpressStore,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        store_prompt: bool = True,
    ) -> None:
        if not isinstance(store, ImpressStore):
            raise TypeError(f"store must be an ImpressStore, got {type(store).__name__}")
        ids, mask = _check_inputs(input_ids, attention_mask, store.spec.vocab_size)
        self.store = store
        self.store_prompt = store_prompt
        self.stats = RequestStats()
        self._ids = ids
        self._mask = mask
        self._state = "ready"
        self._prompt_checked = False
        self._consumed = 0
        self._written = False
        self._sparse: _SparsePlan | None = None
        self._queries: dict[int, torch.Tensor] = {}
        #: sparse prefill: ``selections[layer][batch_row]`` = prefix positions attended
        #: (relative to the row's first real token; ``[k]`` shared or ``[kv_heads, k]``)
        self.selections: dict[int, dict[int, torch.Tensor]] = {}
        self._memo: dict[BlockKey, memoryview] = {}
        self._full: Future[tuple[torch.Tensor, torch.Tensor, int]] | None = None
        self._lease: PrefixLease | None = None
        t0 = time.perf_counter()
        reused, prefix_k, prefix_v = self._load_prefix()
        self.stats.load_seconds = time.perf_counter() - t0
        self._reused = reused
        hidden = reused - self._sparse.k if self._sparse is not None else 0
        layers = [
            ImpressLayer(
                None if prefix_k is None else prefix_k[i],
                None if prefix_v is None else prefix_v[i],
                reused,
                hidden,
            )
            for i in range(store.spec.num_layers)
        ]
        super().__init__(layers=layers)
        _install_hooks(store.model)

    # -- reading the prefix -----------------------------------------------------------
    @property
    def _pads(self) -> list[int]:
        """Left-padding columns of every row."""
        return (self._ids.shape[1] - self._mask.sum(dim=1)).tolist()

    def _release_lease(self) -> None:
        """The request holds what it needs in memory: its prefixes may be evicted again."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _load_prefix(self) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        store, spec = self.store, self.store.spec
        batch = self._ids.shape[0]
        pads = self._pads
        rows = [self._ids[i, pads[i]:].tolist() for i in range(batch)]
        for _ in range(_MAX_QUARANTINE_RETRIES):
            matches = [store.match(toks, limit=len(toks) - 1) for toks in rows]
            # no disk eviction of these prefixes until their rows are in memory
            self._release_lease()
            self._lease = store.lease(matches)
            reused = min(p + m.length for p, m in zip(pads, matches))
            self.stats = RequestStats(quarantined_files=self.stats.quarantined_files)
            self.stats.reused_columns = reused
            for i, (toks, m) in enumerate(zip(rows, matches)):
                used = max(0, reused - pads[i])
                self.stats.rows.append(RowStats(len(toks), m.length, used, len(toks) - used))
            self.stats.matched_tokens = sum(r.matched_tokens for r in self.stats.rows)
            self.stats.computed_tokens = sum(r.computed_tokens for r in self.stats.rows)
            if reused == 0:
                self._release_lease()
                return 0, None, None
            k = math.ceil(store.config.important_ratio * reused)
            if store.config.selection == "block":
                # whole blocks are read anyway: use every row of them
                ct = store.config.chunk_tokens
                k = min(reused, math.ceil(k / ct) * ct)
            if k < reused:
                try:
                    self._sparse = self._plan_sparse(matches, pads, reused, k)
                except CorruptBlockError as exc:
                    store.quarantine(exc.file_id, str(exc))
                    self.stats.quarantined_files += 1
                    continue
                return reused, None, None
            shape = (spec.num_layers, batch, spec.num_kv_heads, reused, spec.head_dim)
            alloc = torch.zeros if max(pads) > 0 else torch.empty  # padding columns must be zeros
            keys = alloc(shape, dtype=spec.torch_kv_dtype)
            values = alloc(shape, dtype=spec.torch_kv_dtype)
            try:
                for i, m in enumerate(matches):
                    used = reused - pads[i]
                    if used <= 0:
                        continue
                    loaded = store.load(_cut(m, used), out=(keys[:, i, :, pads[i]:], values[:, i, :, pads[i]:]))
                    self.stats.bytes_read_disk += loaded.bytes_read
                    self.stats.blocks_read += loaded.blocks_read
            except CorruptBlockError as exc:
                store.quarantine(exc.file_id, str(exc))
                self.stats.quarantined_files += 1
                continue
            self._release_lease()
            return reused, keys, values
        raise CacheUsageError("too many damaged chunk files while loading a prefix; see the log")

    def _plan_sparse(self, matches: list[Match], pads: list[int], reused: int, k: int) -> _SparsePlan:
        """Read the probe keys of every row's prefix (verified) and plan the prefill."""
        store = self.store
        layouts: list[PrefixLayout | None] = []
        probes: list[list[torch.Tensor] | None] = []
        for i, m in enumerate(matches):
            used = reused - pads[i]
            if used <= 0:
                layouts.append(None)
                probes.append(None)
                continue
            lay = store.layout(_cut(m, used))
            layouts.append(lay)
            if store.config.selection in BASELINES:
                probes.append(None)  # baselines do not probe
                continue
            raw, nbytes = store.load_probes(lay)
            self.stats.bytes_read_probe += nbytes
            self.stats.bytes_read_disk += nbytes
            probes.append(raw)
        return _SparsePlan(k, layouts, probes)

    # -- transformers hooks ------------------------------------------------------------
    @property
    def wants_queries(self) -> bool:
        """True while a sparse prefill still needs the new tokens' queries."""
        return self._sparse is not None and not self._written

    def capture_queries(self, layer_idx: int, queries: torch.Tensor) -> None:
        """Receive ``[batch, q_heads, n, head_dim]`` post-RoPE queries of one layer."""
        if not self.layers[layer_idx].is_initialized:
            self._queries[layer_idx] = queries.detach().float()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if self._sparse is not None and not layer.is_initialized:
            layer._prefix = self._select_prefix(layer_idx, key_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if (
            not self._written
            and layer_idx == len(self.layers) - 1
            and layer.get_seq_length() >= self._ids.shape[1]
        ):
            self._written = True
            if self._sparse is not None:
                self._finish_sparse_prefill()
            elif self.store_prompt:
                self._store_prompt()
        return keys, values

    def _select_prefix(self, layer_idx: int, key_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick and load this layer's prefix rows for every batch row."""
        plan = self._sparse
        assert plan is not None
        queries = self._queries.pop(layer_idx, None)
        if queries is None:
            raise CacheUsageError(
                f"no queries were captured for layer {layer_idx}; sparse prefix loading needs "
                "ImpressCache to be used through the model's forward (generate or model(...))"
            )
        store, spec, cfg = self.store, self.store.spec, self.store.config
        batch = key_states.shape[0]
        shape = (batch, spec.num_kv_heads, plan.k, spec.head_dim)
        pk = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        pv = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        sims, thresholds, fell_back = [], [], False
        for i in range(batch):
            src = plan.row_of(i)
            lay = plan.layouts[src]
            if lay is None:
                continue
            k_i = min(plan.k, lay.length)
            raw = plan.probes[src]
            probe_keys = (
                None
                if raw is None
                else probe_codec.decode(raw[layer_idx], len(store.probe.kv_heads), spec.head_dim, store.probe.encoding)
            )

            def read_units(
                units: Sequence[int], rows: torch.Tensor | None = None, lay: PrefixLayout = lay
            ) -> tuple[list[torch.Tensor], int]:
                return self._read_units(lay, layer_idx, units, rows)

            try:
                if k_i == lay.length:
                    units = list(range(len(lay.units)))
                    blocks, nbytes = read_units(units)
                    sel_k, sel_v = gather_all(lay, blocks)
                    rows = torch.arange(lay.length)
                    used = sel_k.numel() * sel_k.element_size() * 2
                    sim, thr, fb = 1.0, 0.0, False
                else:
                    sel = select_row(
                        queries=queries[i],
                        new_keys=key_states[i],
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
                    sel_k, sel_v, nbytes, used = sel.keys, sel.values, sel.bytes_read, sel.bytes_used
                    sim, thr, fb = sel.similarity, sel.threshold, sel.fell_back
                    rows = sel.rows
            except CorruptBlockError as exc:
                store.quarantine(exc.file_id, str(exc))
                self.stats.quarantined_files += 1
                raise CorruptBlockError(
                    f"{exc}. The file was quarantined; this request cannot recompute those tokens any more. "
                    "Retry the request: it will recompute them.",
                    exc.file_id,
                ) from exc
            self.selections.setdefault(layer_idx, {})[i] = rows
            pk[i, :, plan.k - k_i :] = sel_k
            pv[i, :, plan.k - k_i :] = sel_v
            self.stats.bytes_read_rows += nbytes
            self.stats.bytes_read_disk += nbytes
            self.stats.bytes_used_rows += used
            if layer_idx == 0:
                self.stats.loaded_tokens += k_i
            sims.append(sim)
            thresholds.append(thr)
            fell_back |= fb
        self.stats.layer_similarity.append(sum(sims) / max(1, len(sims)))
        self.stats.layer_threshold.append(sum(thresholds) / max(1, len(thresholds)))
        if fell_back:
            self.stats.fallback_layers.append(layer_idx)
        return pk, pv

    def _read_units(
        self, lay: PrefixLayout, layer_idx: int, units: Sequence[int], rows: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], int]:
        """Blocks of ``units`` for one layer; ``rows`` are the selected positions (for the
        blocks' importance shares)."""
        keys = [(lay.units[u].file_id, KV, layer_idx, lay.units[u].block) for u in units]
        share_of: dict[BlockKey, float] = {}
        if rows is not None:
            counts = torch.bincount(lay.unit_of[rows.reshape(-1)], minlength=len(lay.units))
            per_head = rows.shape[0] if rows.dim() == 2 else 1
            idx = torch.as_tensor(list(units), dtype=torch.long)
            shares = (counts[idx].double() / per_head / lay.unit_count[idx]).clamp(max=1.0).tolist()
            share_of = dict(zip(keys, shares))
        missing = sorted({key for key in keys if key not in self._memo})
        views, nbytes = self.store.read_blocks(missing, [share_of.get(key, 1.0) for key in missing])
        self.stats.blocks_read += len(missing)
        self._memo.update(zip(missing, views))
        return [self.store.kv_block(self._memo[key]) for key in keys], nbytes

    def _finish_sparse_prefill(self) -> None:
        """After the prefill: final I/O statistics; start reading the rest of the prefix."""
        read = self.stats.bytes_read_rows
        self.stats.invalid_io_ratio = max(0.0, 1.0 - self.stats.bytes_used_rows / read) if read else 0.0
        if self.store.config.decode == "full":
            self._full = self.store.fetcher.submit(self._load_full_prefix)
        else:
            self._release_lease()

    def _load_full_prefix(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        plan = self._sparse
        assert plan is not None
        spec = self.store.spec
        batch = self._ids.shape[0]
        shape = (spec.num_layers, batch, spec.num_kv_heads, self._reused, spec.head_dim)
        keys = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        values = torch.zeros(shape, dtype=spec.torch_kv_dtype)
        nbytes = 0
        for i in range(batch):
            lay = plan.layouts[plan.row_of(i)]
            if lay is None:
                continue
            pad = self._reused - lay.length
            loaded = self.store.load(lay.segments, out=(keys[:, i, :, pad:], values[:, i, :, pad:]), memo=self._memo)
            nbytes += loaded.bytes_read
            self.stats.blocks_read += loaded.blocks_read
        return keys, values, nbytes

    def _restore_full_prefix(self) -> None:
        """First decode step with ``decode="full"``: attend to the whole prefix from now on."""
        assert self._full is not None
        try:
            keys, values, nbytes = self._full.result()
        except CorruptBlockError as exc:
            self._full = None
            self.store.quarantine(exc.file_id, str(exc))
            self.stats.quarantined_files += 1
            raise CorruptBlockError(
                f"{exc}. The file was quarantined; decoding cannot continue against the whole prefix. "
                "Retry the request (or use decode='keep').",
                exc.file_id,
            ) from exc
        self._full = None
        self._release_lease()
        self.stats.bytes_read_decode += nbytes
        self.stats.bytes_read_disk += nbytes
        for i, layer in enumerate(self.layers):
            layer.restore_prefix(keys[i], values[i])
        self._memo.clear()

    def _store_prompt(self) -> None:
        seq = self._ids.shape[1]
        pads = self._pads
        seen: set[tuple[int, ...]] = set()
        for i in range(self._ids.shape[0]):
            toks = tuple(self._ids[i, pads[i]:].tolist())
            if toks in seen:
                continue
            seen.add(toks)
            keys = [layer.keys[i, :, pads[i]:seq] for layer in self.layers]
            values = [layer.values[i, :, pads[i]:seq] for layer in self.layers]
            self.store.put_async(toks, keys, values)
            self.stats.stored_prompts += 1

    def check_prompt(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        """Called by ``generate`` (through ``prepare_inputs_for_generation``) with the whole prompt.

        The model's forward only sees the tokens after the reused prefix, so this is
        where a cache built for one prompt and used with another is caught.
        """
        if self._state != "ready" or self._prompt_checked:
            return
        if input_ids is None:
            raise CacheUsageError("ImpressCache needs input_ids; inputs_embeds alone are not supported")
        self._match_batch(input_ids.shape[0])
        if input_ids.shape != self._ids.shape or not torch.equal(input_ids.to("cpu"), self._ids):
            raise CacheUsageError(
                "the input_ids given to generate differ from those this ImpressCache was built for; "
                "pass the same input_ids to ImpressCache(...) and generate(...), and build a new cache per request"
            )
        mask = (
            torch.ones_like(self._ids, dtype=torch.bool)
            if attention_mask is None
            else attention_mask.to("cpu").bool()
        )
        if mask.shape != self._mask.shape or not torch.equal(mask, self._mask):
            raise CacheUsageError(
                "the attention_mask given to generate differs from the one ImpressCache was built with; "
                "pass the same attention_mask to ImpressCache(store, input_ids, attention_mask=...)"
            )
        self._prompt_checked = True

    def check_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        """Called before every model forward that uses this cache (see ``_install_hooks``)."""
        if input_ids is None:
            raise CacheUsageError("ImpressCache needs input_ids; inputs_embeds alone are not supported")
        self._match_batch(input_ids.shape[0])
        seq = self._ids.shape[1]
        q = input_ids.shape[1]
        if self._state == "decoding":
            if q != 1:
                raise CacheUsageError(
                    "this ImpressCache already served a request; build a new ImpressCache for every "
                    "generate call (multi-token steps such as assisted decoding are not supported either)"
                )
            if self._full is not None:
                self._restore_full_prefix()
            return
        start = self._reused if self._state == "ready" else self._consumed
        expected = self._ids[:, start : start + q]
        if q > seq - start or not torch.equal(input_ids.to("cpu"), expected):
            raise CacheUsageError(
                "the input_ids given to the model differ from those this ImpressCache was built for; "
                "pass the same input_ids to ImpressCache(...) and generate(...), and build a new cache per request"
            )
        if attention_mask is not None and attention_mask.dim() == 2:
            m = attention_mask[:, : self._reused].to("cpu").bool()
            if m.shape != (self._ids.shape[0], self._reused) or not torch.equal(m, self._mask[:, : self._reused]):
                raise CacheUsageError(
                    "the attention_mask given to generate differs from the one ImpressCache was built with; "
                    "pass the same attention_mask to ImpressCache(store, input_ids, attention_mask=...)"
                )
        self._consumed = start + q
        self._state = "prefill" if self._consumed < seq else "decoding"

    def _match_batch(self, rows: int) -> None:
        batch = self._ids.shape[0]
        if rows == batch:
            return
        if self._state != "ready" or rows % batch:
            raise CacheUsageError(f"this cache was built for a batch of {batch} rows, the model got {rows}")
        self.expand(rows // batch)

    def expand(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (for ``num_return_sequences`` or beams)."""
        self.batch_repeat_interleave(repeats)
        if self._sparse is not None:
            self._sparse.repeats *= repeats
        self._ids = self._ids.repeat_interleave(repeats, 0)
        self._mask = self._mask.repeat_interleave(repeats, 0)

    @property
    def reused_tokens(self) -> int:
        """Columns of the prompt served from the store (the same for every row)."""
        return self._reused


def _cut(match: Match, n: int) -> list[Segment]:
    out: list[Segment] = []
    for seg in match.segments:
        if n <= 0:
            break
        take = min(seg.length, n)
        out.append(Segment(seg.node, take))
        n -= take
    return out


def _check_inputs(
    input_ids: Any, attention_mask: Any, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(input_ids, torch.Tensor):
        raise CacheUsageError(
            f"input_ids must be a torch.Tensor of token ids of shape [batch, seq], got {type(input_ids).__name__}"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise CacheUsageError(f"input_ids must have shape [batch, seq] with batch, seq >= 1, got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise CacheUsageError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    ids = input_ids.detach().to("cpu", torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise CacheUsageError(f"input_ids must be token ids in [0, {vocab_size}), got values up to {int(ids.max())}")
    if attention_mask is None:
        mask = torch.ones_like(ids, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(ids.shape):
            raise CacheUsageError(
                f"attention_mask must be a tensor of the same shape as input_ids {tuple(ids.shape)}, "
                f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}"
            )
        mask = attention_mask.detach().to("cpu").bool()
        lengths = mask.sum(dim=1)
        seq = ids.shape[1]
        left_padded = torch.arange(seq).unsqueeze(0) >= (seq - lengths).unsqueeze(1)
        if not torch.equal(mask, left_padded) or int(lengths.min()) < 1:
            raise CacheUsageError(
                "attention_mask must be left padding only (zeros then ones, at least one token per row); "
                "set tokenizer.padding_side = 'left'"
            )
    return ids, mask


_hooked: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _install_hooks(model: torch.nn.Module) -> None:
    """Once per model: validate what ``generate`` and ``forward`` pass to an ImpressCache.

    ``prepare_inputs_for_generation`` sees the whole prompt (the forward only sees the
    tokens after the reused prefix); a forward pre-hook checks every step.
    """
    if model in _hooked:
        return

    def pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values")
        if isinstance(cache, ImpressCache):
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache.check_forward(ids, kwargs.get("attention_mask"))

    model.register_forward_pre_hook(pre_forward, with_kwargs=True)
    _install_query_capture(model)
    original = model.prepare_inputs_for_generation

    def prepare_inputs_for_generation(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values")
        if isinstance(cache, ImpressCache):
            cache.check_prompt(input_ids, kwargs.get("attention_mask"))
        return original(input_ids, *args, **kwargs)

    model.prepare_inputs_for_generation = prepare_inputs_for_generation
    _hooked.add(model)


_capture = threading.local()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _install_query_capture(model: torch.nn.Module) -> None:
    """Hand each layer's post-RoPE queries to an ImpressCache doing a sparse prefill.

    The cache's ``update`` receives keys and values only. A pre-hook on every attention
    module notes the cache and the rotary ``position_embeddings``; a forward hook on the
    module that produces the queries (``q_norm`` where the architecture has one, else
    ``q_proj``) takes its output, applies the rotation and passes it on. Nothing is
    recomputed, and nothing runs unless a sparse prefill is in progress.
    """
    inner = getattr(model, "model", model)
    for layer in getattr(inner, "layers", []):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "q_proj"):
            continue
        source = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj

        def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            cache = kwargs.get("past_key_values")
            if isinstance(cache, ImpressCache) and cache.wants_queries:
                _capture.target = (cache, module.layer_idx, module.head_dim, kwargs.get("position_embeddings"))
            else:
                _capture.target = None

        def took(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            target = getattr(_capture, "target", None)
            if target is None:
                return
            cache, layer_idx, head_dim, rope = target
            _capture.target = None
            q = output.reshape(output.shape[0], output.shape[1], -1, head_dim).transpose(1, 2)
            if rope is not None:
                cos, sin = rope
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                q = q * cos + _rotate_half(q) * sin
            cache.capture_queries(layer_idx, q)

        attn.register_forward_pre_hook(before, with_kwargs=True)
        source.register_forward_hook(took)
