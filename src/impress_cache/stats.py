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
    blocks, including alignment gaps inside merged reads).
    """

    matched_tokens: int = 0
    computed_tokens: int = 0
    reused_columns: int = 0
    bytes_read_disk: int = 0
    blocks_read: int = 0
    load_seconds: float = 0.0
    quarantined_files: int = 0
    stored_prompts: int = 0
    rows: list[RowStats] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
