"""One request's plan: which stored prefix it reuses and how its rows get into the cache.

Every batch row is matched (at most ``len - 1`` tokens, since ``generate`` must compute
one token), the matched prefixes are leased, and all rows reuse the same number of
columns ``C = min_i(pad_i + match_i)`` (a cache holds one sequence length). Then:

* dense (``k == C``, always with ``important_ratio=1.0``): every prefix row is read now;
* sparse: the probe-key copies are read now (verified) and each layer's rows are chosen
  during the prefill (`SparsePrefill`); with ``decode="full"`` the whole prefix is read
  in the background after the prefill and restored before the first decode step.

A damaged chunk file found here is quarantined and the request matches again (a shorter
prefix, whose tokens it computes), up to `MAX_QUARANTINE_RETRIES` times.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future

import torch

from ..errors import CacheUsageError, CorruptBlockError
from ..index.radix import Match, Segment
from ..selection.modes import BASELINES
from ..stats import RequestStats, RowStats
from ..store.leases import PrefixLease
from ..store.store import ImpressStore
from .sparse import SparsePrefill

MAX_QUARANTINE_RETRIES = 8


class PrefixRequest:
    """Match, lease and load (or plan to load) the stored prefix of one request."""

    def __init__(self, store: ImpressStore, ids: torch.Tensor, mask: torch.Tensor, reuse: bool = True) -> None:
        self.store = store
        self.ids = ids
        self.mask = mask
        #: False: match nothing (a forward that computes the whole prompt; it is still stored)
        self.reuse = reuse
        self.stats = RequestStats()
        #: columns of the prompt served from the store (the same for every row)
        self.reused = 0
        self.sparse: SparsePrefill | None = None
        #: dense reuse: ``[layers, batch, kv_heads, reused, head_dim]`` keys and values
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lease: PrefixLease | None = None
        self._full: Future[tuple[torch.Tensor, torch.Tensor, int, int]] | None = None
        t0 = time.perf_counter()
        self._plan()
        self.stats.load_seconds = time.perf_counter() - t0

    @property
    def pads(self) -> list[int]:
        """Left-padding columns of every row."""
        return (self.ids.shape[1] - self.mask.sum(dim=1)).tolist()

    def release_lease(self) -> None:
        """The request holds what it needs in memory: its prefixes may be evicted again."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _plan(self) -> None:
        store = self.store
        pads = self.pads
        rows = [self.ids[i, pads[i] :].tolist() for i in range(self.ids.shape[0])]
        for _ in range(MAX_QUARANTINE_RETRIES):
            matches = [store.match(toks, limit=len(toks) - 1 if self.reuse else 0) for toks in rows]
            # no disk eviction of these prefixes until their rows are in memory
            self.release_lease()
            self._lease = store.lease(matches)
            self.reused = reused = min(p + m.length for p, m in zip(pads, matches))
            self.stats = RequestStats(quarantined_files=self.stats.quarantined_files)
            self.stats.reused_columns = reused
            for i, (toks, m) in enumerate(zip(rows, matches)):
                used = max(0, reused - pads[i])
                self.stats.rows.append(RowStats(len(toks), m.length, used, len(toks) - used))
            self.stats.matched_tokens = sum(r.matched_tokens for r in self.stats.rows)
            self.stats.computed_tokens = sum(r.computed_tokens for r in self.stats.rows)
            if reused == 0:
                self.release_lease()
                return
            try:
                k = self._rows_per_layer(reused)
                if k < reused:
                    self.sparse = self._plan_sparse(matches, pads, reused, k)
                else:
                    self.prefix = self._load_dense(matches, pads, reused)
                    self.release_lease()
                return
            except CorruptBlockError as exc:
                store.quarantine(exc.file_id, str(exc))
                self.stats.quarantined_files += 1
        raise CacheUsageError("too many damaged chunk files while loading a prefix; see the log")

    def _rows_per_layer(self, reused: int) -> int:
        """``k = ceil(important_ratio * C)``, whole blocks with block selection."""
        cfg = self.store.config
        k = math.ceil(cfg.important_ratio * reused)
        if cfg.selection == "block":
            # whole blocks are read anyway: use every row of them
            k = min(reused, math.ceil(k / cfg.chunk_tokens) * cfg.chunk_tokens)
        return k

    def _load_dense(self, matches: list[Match], pads: list[int], reused: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.store.spec
        shape = (spec.num_layers, self.ids.shape[0], spec.num_kv_heads, reused, spec.head_dim)
        alloc = torch.zeros if max(pads) > 0 else torch.empty  # padding columns must be zeros
        keys = alloc(shape, dtype=spec.torch_kv_dtype)
        values = alloc(shape, dtype=spec.torch_kv_dtype)
        for i, m in enumerate(matches):
            used = reused - pads[i]
            if used > 0:
                loaded = self.store.load(cut(m, used), out=(keys[:, i, :, pads[i] :], values[:, i, :, pads[i] :]))
                self.stats.bytes_read_disk += loaded.bytes_read
                self.stats.blocks_read += loaded.blocks_read
        return keys, values

    def _plan_sparse(self, matches: list[Match], pads: list[int], reused: int, k: int) -> SparsePrefill:
        """Read the probe keys of every row's prefix (verified) and plan the prefill."""
        store = self.store
        layouts, probes = [], []
        for i, m in enumerate(matches):
            used = reused - pads[i]
            lay = store.layout(cut(m, used)) if used > 0 else None
            layouts.append(lay)
            if lay is None or store.config.selection in BASELINES:
                probes.append(None)  # baselines do not probe
                continue
            raw, nbytes = store.load_probes(lay)
            self.stats.bytes_read_probe += nbytes
            self.stats.bytes_read_disk += nbytes
            probes.append(raw)
        return SparsePrefill(store, k, layouts, probes, self.stats)

    # -- after the prefill -------------------------------------------------------------
    def finish_sparse_prefill(self) -> None:
        """Final I/O statistics; with ``decode="full"`` start reading the rest of the prefix."""
        assert self.sparse is not None
        self.sparse.finish()
        if self.store.config.decode == "full":
            self._full = self.store.fetcher.submit(self.sparse.load_full, self.ids.shape[0], self.reused)
        else:
            self.release_lease()

    @property
    def full_pending(self) -> bool:
        return self._full is not None

    def take_full_prefix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the background read of the whole prefix (``decode="full"``)."""
        assert self._full is not None
        fut, self._full = self._full, None
        try:
            keys, values, nbytes, blocks = fut.result()
        except CorruptBlockError as exc:
            self.store.quarantine(exc.file_id, str(exc))
            self.stats.quarantined_files += 1
            raise CorruptBlockError(
                f"{exc}. The file was quarantined; decoding cannot continue against the whole prefix. "
                "Retry the request (or use decode='keep').",
                exc.file_id,
            ) from exc
        finally:
            self.release_lease()
        self.stats.bytes_read_decode += nbytes
        self.stats.bytes_read_disk += nbytes
        self.stats.blocks_read += blocks
        assert self.sparse is not None
        self.sparse.memo.clear()
        return keys, values

    def expand(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (for ``num_return_sequences`` or beams)."""
        if self.sparse is not None:
            self.sparse.repeats *= repeats
        self.ids = self.ids.repeat_interleave(repeats, 0)
        self.mask = self.mask.repeat_interleave(repeats, 0)

    def store_prompt(self, layer_keys: list[torch.Tensor], layer_values: list[torch.Tensor]) -> None:
        """Hand every distinct row's K/V (``[batch, kv_heads, >= seq, head_dim]`` per layer)
        to the store's background writer."""
        seq = self.ids.shape[1]
        pads = self.pads
        seen: set[tuple[int, ...]] = set()
        for i in range(self.ids.shape[0]):
            toks = tuple(self.ids[i, pads[i] :].tolist())
            if toks in seen:
                continue
            seen.add(toks)
            self.store.put_async(
                toks, [k[i, :, pads[i] : seq] for k in layer_keys], [v[i, :, pads[i] : seq] for v in layer_values]
            )
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
