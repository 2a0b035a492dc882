"""``important_ratio="auto"``: exact reuse or sparse loading for one request, from the
store's `CostModel` (the decision and what it measures; see `store.costs`)."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from ..selection.scores import attention_column_scores
from ..store.costs import Plan, Prefix
from ..store.layout import PrefixLayout
from ..store.store import ImpressStore

if TYPE_CHECKING:
    from .request import PrefixRequest

T = TypeVar("T")

#: rows and new tokens of the selection calibration
_CAL_ROWS, _CAL_NEW = 4096, 16
#: what choosing costs besides scoring (top-k, agreement, gathering the chosen rows), as
#: a factor on the scoring time: measured 1.6-2.0 on SmolLM2 (``select_seconds`` against
#: the calibration), rounded up so that the prior leans to exact reuse
_SELECT_OVERHEAD = 2.5


@functools.lru_cache(maxsize=8)
def _calibrate(query_heads: int, kv_heads: int, head_dim: int) -> float:
    """Seconds per prefix row and layer of scoring the probe copy on this machine (best
    of three on random keys; about 70 ms on this project's VM, once per process and shape)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, query_heads, _CAL_NEW, head_dim, generator=gen)
    k = torch.randn(1, kv_heads, _CAL_ROWS, head_dim, generator=gen)
    new = torch.randn(1, kv_heads, _CAL_NEW, head_dim, generator=gen)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        attention_column_scores(q, k, new)
        best = min(best, time.perf_counter() - t0)
    return _SELECT_OVERHEAD * best / _CAL_ROWS


def select_prior(store: ImpressStore) -> float:
    """The calibration for this store's probe heads (every query head of the probed groups scores)."""
    cfg = getattr(store.model, "config", None)
    q_heads = getattr(cfg, "num_attention_heads", None) or store.spec.num_kv_heads
    group = max(1, int(q_heads) // max(1, store.spec.num_kv_heads))
    kv = len(store.probe.kv_heads)
    return _calibrate(kv * group, kv, store.spec.head_dim)


def plan(req: PrefixRequest, reused: int, scored_layers: int, layouts: list[PrefixLayout | None]) -> Plan:
    """Exact reuse or sparse loading for this request, and the ratio of a sparse plan
    (``auto_ratio`` or a larger one: `CostModel.plan`)."""
    store = req.store
    costs = store.costs
    if costs.select_prior is None:
        costs.select_prior = functools.partial(select_prior, store)
    spec = store.spec
    row_bytes = spec.kv_bytes_per_token // max(1, spec.num_layers)  # one row of one layer, K and V
    full = 0
    probe_bytes = 0
    source = "disk"
    for lay in layouts:
        if lay is None:
            continue
        resident, linked = store.where(lay)
        source = "remote" if linked else source
        full += int(lay.length * row_bytes * spec.num_layers * (1.0 - resident))
        probe_bytes += lay.length * store.probe.record_bytes * scored_layers
    scored_share = scored_layers / max(1, spec.num_layers)

    def sparse_bytes(ratio: float) -> int:  # chosen rows of the scored layers, every row of the rest, the probe copy
        return int(full * (scored_share * ratio + 1 - scored_share)) + probe_bytes

    cfg = store.config
    req.cost_source = source
    prefix = Prefix(
        source, reused, new_tokens(req), scored_layers, full, sparse_bytes, cfg.decode == "full" and cfg.guard_margin > 0
    )
    return costs.plan(prefix, cfg.auto_ratio)


def new_tokens(req: PrefixRequest) -> int:
    """Tokens the prefill computes per batch row (the widest row's)."""
    return int(req.ids.shape[1]) - req.reused


def observe_prefill(req: PrefixRequest, loader_seconds: float | None, loader_bytes: int) -> None:
    """After a prefill that reused a prefix: what it measured (exact or sparse)."""
    costs, stats, new = req.store.costs, req.stats, new_tokens(req)
    if req.sparse is None:
        if loader_seconds is not None:
            costs.observe_read(req.cost_source, loader_bytes, loader_seconds)
        costs.observe_exact(req.reused, new, stats.prefill_seconds, stats.io_wait_seconds + stats.probe_seconds)
    else:
        costs.observe_sparse(
            req.reused, new, len(req.sparse_layers), stats.select_seconds, stats.io_wait_seconds, stats.bytes_read_rows
        )


def observe_whole_prompt(req: PrefixRequest) -> None:
    """After a prefill that reused nothing (one batch row): its cost per token."""
    if req.ids.shape[0] == 1 and req.stats.prefill_seconds > 0:
        req.store.costs.observe_tokens(int(req.ids.shape[1]), req.stats.prefill_seconds)


def timed_full_read(req: PrefixRequest, read: Callable[[], T]) -> T:
    """Run the background read of a sparse request's whole prefix, and let the cost model
    learn the bandwidth it got (``read`` returns ``(keys, values, bytes, blocks)``)."""
    t0 = time.perf_counter()
    out = read()
    req.store.costs.observe_read(req.cost_source, out[2], time.perf_counter() - t0)  # type: ignore[index]
    return out
