"""One request's plan: which stored prefix it reuses and how its rows get into the cache.

Every batch row is matched (at most ``len - 1`` tokens, since ``generate`` must compute
one token), the matched prefixes are leased, and all rows reuse the same number of
columns ``C = min_i(pad_i + match_i)`` (a cache holds one sequence length). Then:

* dense (``k == C``, always with ``important_ratio=1.0``): a `DenseLoader` starts
  reading every prefix row, layer by layer, while the model computes;
* sparse: a `ProbeLoader` starts reading the probe-key copies and each layer's rows are
  chosen during the prefill (`SparsePrefill`); with ``decode="full"`` the whole prefix is
  read in the background after the prefill and restored before the first decode step.

Nothing is read before the cache is built, so a damaged chunk file is found during the
prefill: it is quarantined and the prefix is recomputed on the side for the remaining
layers (`recovery`); later requests match a shorter prefix.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import CacheUsageError, CorruptBlockError, ImpressError, StoreFormatError, StoreIOError
from ..index.radix import Match, Segment
from ..model_info import ModelSpec
from ..selection.modes import BASELINES
from ..stats import RequestStats, RowStats
from ..store.leases import PrefixLease
from ..store.store import ImpressStore
from . import planner
from .layers import to_stored
from .loaders import DenseLoader, ProbeLoader, prefix_buffer
from .recovery import recompute_prefix
from .reselect import reselects
from .sparse import SparsePrefill

#: matches a request tries when a matched file went before it was leased
_REMATCHES = 3

log = logging.getLogger(__name__)


def _log_failure(fut: Future[Any]) -> None:
    if fut.exception() is not None:
        log.warning("applying the memory tiers' recorded accesses failed: %s", fut.exception())


class PrefixRequest:
    """Match, lease and start loading the stored prefix of one request."""

    def __init__(
        self, store: ImpressStore, ids: torch.Tensor, mask: torch.Tensor, reuse: bool = True, namespace: str | None = None
    ) -> None:
        self.store = store
        #: what the request matches and stores under (`ImpressCache(namespace=)`)
        self.namespace = namespace
        self.ids = ids
        self.mask = mask
        #: False: match nothing (a forward that computes the whole prompt; it is still stored)
        self.reuse = reuse
        self.stats = RequestStats()
        #: columns of the prompt served from the store (the same for every row)
        self.reused = 0
        #: row ``i`` of the batch ``generate`` runs is row ``rows[i]`` of the prompt the
        #: request was planned for (``num_return_sequences``, beams and row selections
        #: change the batch; the loaders work on the planned rows)
        self.rows = torch.arange(ids.shape[0])
        self._planned = (ids, mask)
        self.sparse: SparsePrefill | None = None
        self._dense: DenseLoader | None = None
        self._lease: PrefixLease | None = None
        self._full: Future[tuple[torch.Tensor, torch.Tensor, int, int]] | None = None
        #: per stored layer: prefix rows it holds (the last ones; ``reused - held`` are hidden)
        self.held: list[int] = [0] * store.spec.num_layers
        #: stored layers whose rows a sparse prefill chooses
        self.sparse_layers: set[int] = set()
        #: a hybrid model's checkpointed states at ``reused`` (see `store.states`)
        self.states: dict[str, torch.Tensor] | None = None
        self._recomputed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        #: the planned batch rows the whole prefix is restored for (``decode="full"``)
        self._full_rows = self.rows
        self.prefill_started: float | None = None
        #: where the prefix's blocks are read from, for the cost model (`planner`)
        self.cost_source = "disk"
        t0 = time.perf_counter()
        try:
            self._plan()
        except (CorruptBlockError, StoreFormatError, StoreIOError) as exc:  # e.g. a file gone after its lease was checked
            self._reuse_nothing(exc)
        self.stats.load_seconds = time.perf_counter() - t0

    @property
    def one_unpadded_row(self) -> bool:
        """One batch row without padding: the only requests whose recurrent states are
        checkpointed or restored (a padded row's states were not measured equal)."""
        return self.ids.shape[0] == 1 and bool(self.mask.all())

    @property
    def pads(self) -> list[int]:
        """Left-padding columns of every row."""
        return (self.ids.shape[1] - self.mask.sum(dim=1)).tolist()

    def end_decoding(self) -> None:
        """Nothing will be read for this request any more (``generate`` returned, or
        keep mode without re-selection): drop the lease and what re-selection keeps."""
        if self.sparse is not None:
            self.sparse.reselector = None
            if self.sparse.probes is not None:
                self.sparse.probes.raw = None
        self.release_lease()

    def release_lease(self) -> None:
        """The request holds what it needs in memory: its prefixes may be evicted again."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _reuse_nothing(self, exc: ImpressError) -> None:
        """The store cannot serve this request (a damaged index, an I/O error): compute
        the whole prompt, as without a store."""
        log.warning("the store at %s cannot serve this request, computing the whole prompt: %s", self.store.path, exc)
        self.release_lease()
        self.reuse = False
        self.reused = 0
        self.sparse = self._dense = None
        self.held = [0] * self.store.spec.num_layers
        self.sparse_layers = set()
        self.stats = RequestStats()
        pads = self.pads
        for i in range(self.ids.shape[0]):
            n = self.ids.shape[1] - pads[i]
            self.stats.rows.append(RowStats(n, 0, 0, n))
        self.stats.computed_tokens = sum(r.computed_tokens for r in self.stats.rows)

    def _plan(self) -> None:
        store = self.store
        pads = self.pads
        rows = [self.ids[i, pads[i] :] for i in range(self.ids.shape[0])]
        t0 = time.perf_counter()
        for attempt in range(_REMATCHES):
            matches = [
                store.match(toks.numpy(), limit=len(toks) - 1 if self.reuse else 0, namespace=self.namespace) for toks in rows
            ]
            self.stats.waited_for_write_seconds += sum(m.waited_s for m in matches)
            self.reused = reused = min(p + m.length for p, m in zip(pads, matches))
            if store.states is not None:  # reuse only up to a checkpoint of every state layer
                self.reused = reused = self._checkpoint(rows, pads, matches)
            if reused == 0:
                break
            k = self._rows_per_layer(reused)
            # no disk eviction of these prefixes until their rows are in memory (with
            # "auto", the access is recorded once the plan says what is loaded)
            self._lease = store.lease(matches, share=None if store.config.auto else k / reused)
            if not self._lease.stale or attempt == _REMATCHES - 1:
                break  # (still stale after the last match: its reads fail and recompute)
            # a matched node was rewritten (or evicted) before the lease: match again, and
            # read the node that replaced it
            self.release_lease()
        for i, (toks, m) in enumerate(zip(rows, matches)):
            used = max(0, reused - pads[i])
            self.stats.rows.append(RowStats(len(toks), m.length, used, len(toks) - used))
        self.stats.reused_columns = reused
        self.stats.matched_tokens = sum(r.matched_tokens for r in self.stats.rows)
        self.stats.computed_tokens = sum(r.computed_tokens for r in self.stats.rows)
        if reused == 0:
            self.stats.match_seconds = time.perf_counter() - t0
            return
        layouts = [store.layout(cut(m, reused - pads[i])) if reused > pads[i] else None for i, m in enumerate(matches)]
        self.stats.match_seconds = time.perf_counter() - t0
        room = self.ids.shape[1] - reused
        self.held, self.sparse_layers = held_rows(store.spec, reused, k)
        if store.config.auto and self.sparse_layers:  # exact reuse or sparse loading, by the cost model
            choice = planner.plan(self, reused, len(self.sparse_layers), layouts)
            self.stats.plan, self.stats.plan_reason = choice.mode, choice.reason
            self.stats.predicted_exact_seconds, self.stats.predicted_sparse_seconds = choice.exact_seconds, choice.sparse_seconds
            self.stats.plan_ratio = choice.ratio
            k = reused if choice.ratio is None else self._rows_per_layer(reused, choice.ratio)
            self.held, self.sparse_layers = held_rows(store.spec, reused, k)
        if store.config.auto:
            store.access(matches, k / reused if self.sparse_layers else 1.0)
        if self.sparse_layers:
            probes = (
                None
                if store.config.selection in BASELINES
                else ProbeLoader(store, layouts, self.stats, keep_raw=reselects(store.config), layers=self.sparse_layers)
            )
            self.sparse = SparsePrefill(store, k, layouts, probes, self.stats, room, self)
        if len(self.sparse_layers) < len(self.held):
            dense: list[int | None] = [None if s in self.sparse_layers else h for s, h in enumerate(self.held)]
            self._dense = DenseLoader(store, layouts, pads, reused, room, self.stats, dense)

    def _checkpoint(self, rows: list[torch.Tensor], pads: list[int], matches: list[Match]) -> int:
        """A hybrid model's request reuses a prefix only up to the largest stored
        checkpoint of its states inside the match (candidates: the node boundaries of the
        match, where stored prompts end); one unpadded row only (kept conservative:
        checkpoints are taken and restored for single unpadded rows). The checkpoint's
        bytes count as read from disk."""
        assert self.store.states is not None
        if not self.one_unpadded_row or not matches[0].length:
            return 0
        ends, at = [], 0
        for seg in matches[0].segments:
            at += seg.length
            ends.append(at)
        key = self.store.namespaces.key(rows[0].numpy(), self.namespace)
        if key is None:
            return 0
        p, self.states = self.store.states.best(key, ends)
        if self.states is not None:
            self.stats.bytes_read_disk += sum(t.numel() * t.element_size() for t in self.states.values())
        return p

    def _rows_per_layer(self, reused: int, ratio: float | None = None) -> int:
        """``k = ceil(ratio * C)`` (by default ``important_ratio``, or ``auto_ratio`` with
        "auto"), whole blocks with block selection."""
        cfg = self.store.config
        k = math.ceil((cfg.sparse_ratio if ratio is None else ratio) * reused)
        if cfg.selection == "block":
            # whole blocks are read anyway: use every row of them
            k = min(reused, math.ceil(k / cfg.chunk_tokens) * cfg.chunk_tokens)
        return k

    # -- during the prefill ------------------------------------------------------------
    def prefix_for(self, layer: int, key_states: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The layer's prefix rows in a buffer with room for the new tokens:
        ``([2, batch, kv_heads, held + new, head_dim], held)``."""
        try:
            if layer in self.sparse_layers:
                assert self.sparse is not None
                buf, held = self.sparse.select(layer, key_states, self._recomputed)
            elif self._recomputed is not None:
                buf, held = self._recomputed_layer(layer), self.held[layer]
            else:
                assert self._dense is not None
                buf, held = self._dense.layer(layer), self.held[layer]
        except (CorruptBlockError, StoreFormatError, StoreIOError) as exc:
            self._recover(exc)
            return self.prefix_for(layer, key_states)
        if layer not in self.sparse_layers and not torch.equal(self.rows, torch.arange(len(self.rows))):
            buf = buf.index_select(1, self.rows)  # dense buffers hold the planned rows
        return buf, held

    def _recover(self, exc: ImpressError) -> None:
        """Quarantine a damaged file and recompute the prefix for the remaining layers
        (also when the store cannot be read at all)."""
        if self._recomputed is not None:
            raise CacheUsageError(f"a recomputed prefix failed to load: {exc}") from exc
        if isinstance(exc, CorruptBlockError):
            self._quarantine(exc)
        else:
            log.warning("reading the prefix from %s failed, recomputing it: %s", self.store.path, exc)
        if self._dense is not None:
            self._dense.cancel()
        if self.sparse is not None and self.sparse.probes is not None:
            self.sparse.probes.cancel()
        self._recomputed = recompute_prefix(self.store.model, *self._planned, self.reused, self.store.spec)

    def _quarantine(self, exc: CorruptBlockError) -> None:
        try:
            if self.store.quarantine(exc.file_id, str(exc)):
                self.stats.quarantined_files += 1
        except (StoreFormatError, StoreIOError) as err:  # the index cannot record it: recompute anyway
            log.warning("could not quarantine file %s of %s: %s", exc.file_id, self.store.path, err)

    def _recomputed_layer(self, layer: int) -> torch.Tensor:
        assert self._recomputed is not None
        k, v = self._recomputed[layer]
        held = self.held[layer]
        buf = prefix_buffer(self.store, k.shape[0], held, self.ids.shape[1] - self.reused, False)
        buf[0, :, :, :held] = k[:, :, self.reused - held :]
        buf[1, :, :, :held] = v[:, :, self.reused - held :]
        self.stats.recomputed_layers += 1
        return buf

    def store_sequence(self, layers: list[Any], fed: list[torch.Tensor], states: dict[str, torch.Tensor] | None) -> None:
        """After ``generate``: store the prompt and the tokens fed back while decoding
        (``fed``, ``[batch, 1]`` each), whose K/V the cache ``layers`` hold, so that the
        next turn of a conversation matches through this answer; with ``states`` (a hybrid
        model's, batch of one), a checkpoint after them too."""
        ids = torch.cat([self.ids, *[f.to(self.ids.device) for f in fed]], dim=1)
        if any(la.get_seq_length() != ids.shape[1] for la in layers):
            return  # the cache holds something else (a crop, a rollback): store nothing
        mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], len(fed))], dim=1)
        self._store_prompt(layers, ids, mask, answers=True)
        if states is not None and self.store.states is not None:
            self.store.states.put_async(self.store.namespaces.key(ids[0].numpy(), self.namespace, create=True).tolist(), states)

    def finish_prefill(self, layers: list[Any], store_prompt: bool) -> None:
        """After the last layer: final statistics; with ``decode="full"`` start reading the
        rest of the prefix; store the prompt (dense reuse, or nothing reused)."""
        if self.prefill_started is not None:
            self.stats.prefill_seconds = time.perf_counter() - self.prefill_started
        if self._recomputed is not None and self.stats.recomputed_layers >= self.store.spec.num_layers:
            self._nothing_reused()  # every layer's prefix came from the recompute, none from the store
        if self.reused and self._recomputed is None and not self.stats.recomputed_layers:
            dense = self._dense if self.sparse is None else None
            planner.observe_prefill(self, None if dense is None else dense.seconds, 0 if dense is None else dense.disk_bytes)
        elif not self.reused and self.store.config.auto:
            planner.observe_whole_prompt(self)
        if self.sparse is not None:
            self.sparse.finish()
            if self.store.config.decode == "full":
                # the batch's rows as they are now: later reorders apply to the result
                self._full_rows = self.rows.clone()
                if self._recomputed is None:
                    read = functools.partial(self.sparse.load_full, self.rows.tolist(), self.reused)
                    self._full = self.store.fetcher.submit(planner.timed_full_read, self, read)
                else:  # a recovery recomputed the whole prefix: restored from memory, as if read
                    self._full = Future()
                    self._full.set_result((*self._whole_prefix(self._recomputed), 0, 0))
            elif self.sparse.reselector is None or self._recomputed is not None:
                self.end_decoding()  # nothing more to read (re-selection reads the leased files)
            self._settle_tiers()
            return
        self.release_lease()
        self._settle_tiers()
        if store_prompt:
            self._store_prompt(layers)

    def _nothing_reused(self) -> None:
        """The statistics of a request whose prefix was recomputed for every layer: its
        matched tokens were computed, not reused (the stored match stays in ``stored_match``)."""
        for row in self.stats.rows:
            row.computed_tokens += row.matched_tokens
            row.matched_tokens = 0
        self.stats.matched_tokens = 0
        self.stats.computed_tokens = sum(r.computed_tokens for r in self.stats.rows)

    def _settle_tiers(self) -> None:
        """Apply the memory tiers' recorded accesses on the fetcher thread, after anything
        this request queued there (off the request's path; see `TouchLog`)."""
        if not self.store.tiers.pending_accesses:
            return
        try:
            fut = self.store.fetcher.submit(self.store.tiers.settle)
        except RuntimeError:  # the store is closing: the next call into the tiers applies them
            return
        fut.add_done_callback(_log_failure)

    @property
    def full_pending(self) -> bool:
        return self._full is not None

    def take_full_prefix(self, before_first_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the background read of the whole prefix (``decode="full"``); its
        bytes count as ``bytes_read_guard`` when the uncertainty guard needs it
        ``before_first_token``, else as ``bytes_read_decode``."""
        assert self._full is not None and self.sparse is not None
        fut, self._full = self._full, None
        try:
            keys, values, nbytes, blocks = fut.result()
        except (CorruptBlockError, StoreFormatError, StoreIOError) as exc:
            if isinstance(exc, CorruptBlockError):
                self._quarantine(exc)
            keys, values = self._whole_prefix(recompute_prefix(self.store.model, *self._planned, self.reused, self.store.spec))
            nbytes = blocks = 0
        finally:
            self.release_lease()
        if before_first_token:
            self.stats.bytes_read_guard += nbytes
        else:
            self.stats.bytes_read_decode += nbytes
        self.stats.bytes_read_disk += nbytes
        self.stats.blocks_read += blocks
        self.sparse.memo.clear()
        return keys, values

    def _whole_prefix(self, rec: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A recomputed prefix (`recompute_prefix`) as `SparsePrefill.load_full` returns the
        read one: ``[layers, batch, kv_heads, reused, head_dim]`` in the stored dtype, for
        the batch rows the whole prefix was asked for (``_full_rows``)."""
        dtype = self.store.spec.torch_kv_dtype
        keys = torch.stack([k for k, _ in rec]).index_select(1, self._full_rows).to(dtype)
        values = torch.stack([v for _, v in rec]).index_select(1, self._full_rows).to(dtype)
        return keys, values

    def expand(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (for ``num_return_sequences`` or beams)."""
        self.select_rows(torch.arange(self.ids.shape[0]).repeat_interleave(repeats))

    def select_rows(self, idx: torch.Tensor) -> None:
        """The batch becomes rows ``idx`` of the current one (repeats, beams, selections)."""
        self.rows = self.rows[idx]
        self.ids = self.ids[idx]
        self.mask = self.mask[idx]

    def _store_prompt(
        self, layers: list[Any], ids: torch.Tensor | None = None, mask: torch.Tensor | None = None, answers: bool = False
    ) -> None:
        """Hand every distinct row's K/V (per stored layer, its cache layer: the rows
        after the ones it hides) to the store's background writer: of the prompt, or of
        ``ids`` (the prompt and the tokens fed back while decoding, left-padded as
        ``mask`` says). Rows a layer hides (a window's) go as zeros, with ``valid_from``
        telling the writer to store nothing unless everything before them is still stored."""
        ids = self.ids if ids is None else ids
        mask = self.mask if mask is None else mask
        seq = ids.shape[1]
        pads = (seq - mask.sum(dim=1)).tolist()
        spec = self.store.spec
        hidden = max((la.hidden for la in layers), default=0)
        seen: set[tuple[int, ...]] = set()
        for i in range(ids.shape[0]):
            toks = tuple(ids[i, pads[i] :].tolist())
            if toks in seen:
                continue
            seen.add(toks)
            keys, values = [], []
            for la in layers:
                k, v = to_stored(spec, la.info, la.keys[i : i + 1], la.values[i : i + 1])
                k, v = k[0, :, : seq - la.hidden], v[0, :, : seq - la.hidden]
                if la.hidden:  # hidden rows: zeros in front (below valid_from, never written)
                    k, v = (torch.nn.functional.pad(t, (0, 0, la.hidden, 0)) for t in (k, v))
                keys.append(k[:, pads[i] :])
                values.append(v[:, pads[i] :])
            try:
                self.store.put_async(toks, keys, values, valid_from=max(0, hidden - pads[i]), namespace=self.namespace)
            except (StoreFormatError, StoreIOError) as exc:
                log.warning("the prompt is not stored: %s", exc)
                continue
            if answers:
                self.stats.stored_answers += 1
            else:
                self.stats.stored_prompts += 1


def cut(match: Match, n: int) -> list[Segment]:
    """The first ``n`` tokens of a match, as segments."""
    out: list[Segment] = []
    for seg in match.segments:
        if n <= 0:
            break
        take = min(seg.length, n)
        out.append(Segment(seg.node, take))
        n -= take
    return out


def held_rows(spec: ModelSpec, reused: int, k: int) -> tuple[list[int], set[int]]:
    """Per stored layer, the prefix rows a request holds, and the layers a sparse
    prefill chooses ``k`` rows for: a window layer holds what its window still sees; full
    layers hold ``k`` rows each when ``k < reused`` and their keys are stored at their own
    width (the probes score them), else every row."""
    infos = [spec.model_layers[m] for m in spec.stored_layers]
    sparse_ok = k < reused and not spec.state_layers and all(
        (i.k_heads, i.k_dim) == (spec.num_kv_heads, spec.head_dim) for i in infos if i.kind == "full"
    )
    held: list[int] = []
    chosen: set[int] = set()
    for s, info in enumerate(infos):
        if info.kind == "window":
            held.append(min(reused, max(info.window - 1, 0)))
        elif sparse_ok:
            held.append(k)
            chosen.add(s)
        else:
            held.append(reused)
    return held, chosen
