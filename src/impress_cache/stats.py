"""Counters a user reads after a request (``cache.stats``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RowStats:
    """One batch row of a request."""

    prompt_tokens: int
    stored_match: int
    matched_tokens: int
    computed_tokens: int


@dataclass
class RequestStats:
    """What one `ImpressCache` reused, computed, read and wrote.

    ``matched_tokens`` and ``computed_tokens`` count real (non-padding) prompt tokens
    summed over the batch: reused from the store, and run through the model. A row may
    have a longer stored match than it reuses (``rows[i].stored_match``) because every
    row of a batch reuses the same number of columns.
    ``bytes_read_disk`` counts the bytes this request asked the disk for (chunk
    blocks, including alignment gaps inside merged reads); with ``important_ratio < 1``
    it splits into ``bytes_read_probe`` (probe-key copies, before the prefill),
    ``bytes_read_rows`` (K/V blocks read during the prefill, those of layers that hold
    their rows without choosing them included: window layers) and ``bytes_read_decode``
    (the rest of the prefix, read after the prefill when ``decode="full"``, or the
    blocks that re-selections read with ``decode="keep"`` and ``keep_reselect``), or
    ``bytes_read_guard`` when the uncertainty guard read that rest before the first
    token (``guard_triggered`` counts those requests; ``first_token_margin`` is the
    smallest top-1/top-2 logit gap after a sparse prefill).
    ``reselections`` counts layer re-selections while decoding (``keep_reselect``), in
    ``reselect_seconds`` (scoring, reads and copies).
    ``refreshed_tokens`` counts new tokens whose K/V were computed again against the
    whole prefix (``refresh_new_tokens``; with ``decode="keep"`` and ``keep_reselect``,
    against the rows re-selected before the first decode step), in ``refresh_seconds``.
    ``loaded_tokens`` counts the prefix rows each layer attended to during the prefill
    (summed over batch rows). ``bytes_unattended_rows`` is the part of the K/V blocks
    read from disk for the prefill that no attention head attends to (from each block's
    share of selected rows), and ``invalid_io_ratio`` its share of those blocks' bytes
    (the same definition as ``store.stats()["invalid_io_ratio"]``).

    Where the time to the first token goes (seconds): ``load_seconds`` building the cache
    (of which ``match_seconds`` matching and leasing); during the prefill,
    ``probe_seconds`` waiting for the probe-key copies, ``select_seconds`` scoring and
    choosing rows, ``io_wait_seconds`` waiting for K/V blocks (reads run in the
    background, layer by layer: only the part the model had to wait for counts), and
    ``prefill_seconds`` the whole prefill forward (the model's own compute is what is
    left after the three waits). ``prefetch_hit_rate`` is, for sparse prefills, the
    share of a layer's selected blocks that were already being read because the
    previous layer selected them; ``recomputed_layers`` counts layers whose prefix rows
    came from recomputing the prefix after a damaged block was found mid-prefill.
    ``blocks_touched`` and ``rows_selected`` sum, over the layers (and planned rows) of
    a sparse prefill, the K/V blocks holding the selected rows and those rows;
    ``blocks_per_selected_row`` is their ratio (``1 / chunk_tokens`` at best: importance
    reordering packs a prefix's important rows into fewer blocks).
    ``waited_for_write_seconds``: how long matching waited for a write still in flight
    (a prompt stored by an earlier request, not committed yet) that gave this request a
    longer match (at most ``config.write_wait_s`` per batch row; 0.0: no wait).
    """

    matched_tokens: int = 0
    computed_tokens: int = 0
    #: with ``important_ratio="auto"``: ``"exact"`` or ``"sparse"``, what the store's cost
    #: model chose for this request, why, and the times it predicted for both (seconds to
    #: the first token); empty for a fixed ratio or nothing reused
    plan: str = ""
    plan_reason: str = ""
    predicted_exact_seconds: float | None = None
    predicted_sparse_seconds: float | None = None
    #: the share of rows a sparse plan loads per scored layer (``auto_ratio`` or a larger
    #: one the cost model found nearly free); ``None`` for an exact plan
    plan_ratio: float | None = None
    reused_columns: int = 0
    bytes_read_disk: int = 0
    blocks_read: int = 0
    load_seconds: float = 0.0
    quarantined_files: int = 0
    stored_prompts: int = 0
    #: rows whose prompt and answer (the tokens fed back while decoding) were handed to
    #: the writer when generate returned (see ``ImpressCache(store_prompt=)``)
    stored_answers: int = 0
    loaded_tokens: int = 0
    bytes_read_probe: int = 0
    bytes_read_rows: int = 0
    bytes_read_decode: int = 0
    bytes_read_guard: int = 0
    refreshed_tokens: int = 0
    refresh_seconds: float = 0.0
    reselections: int = 0
    reselect_seconds: float = 0.0
    guard_triggered: int = 0
    #: time the guard's read of the rest (and the recompute of the new tokens) added
    #: before the first token
    guard_seconds: float = 0.0
    first_token_margin: float | None = None
    bytes_unattended_rows: float = 0.0
    invalid_io_ratio: float = 0.0
    match_seconds: float = 0.0
    waited_for_write_seconds: float = 0.0
    probe_seconds: float = 0.0
    select_seconds: float = 0.0
    io_wait_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefetch_hit_rate: float = 0.0
    recomputed_layers: int = 0
    blocks_touched: int = 0
    rows_selected: int = 0
    layer_similarity: list[float] = field(default_factory=list)
    layer_threshold: list[float] = field(default_factory=list)
    fallback_layers: list[int] = field(default_factory=list)
    #: stored layers whose queries the hooks could not capture (a family whose attention
    #: projects or rotates queries in its own way): they keep the sink and most recent
    #: rows (the ``recent`` baseline) instead of scored ones
    unscored_layers: list[int] = field(default_factory=list)
    rows: list[RowStats] = field(default_factory=list)

    @property
    def blocks_per_selected_row(self) -> float:
        return self.blocks_touched / self.rows_selected if self.rows_selected else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blocks_per_selected_row": self.blocks_per_selected_row}
