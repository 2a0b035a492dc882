"""Least-frequently-used policy."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from .base import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    """Evict the block with the fewest recorded accesses; ties go to the least recent.

    Counts never decay. Importance shares are tracked only to give the block an
    importance class.
    """

    name = "lfu"

    def priority(self, key: Hashable, now: float) -> float:
        """Number of recorded accesses."""
        return float(self._get(key).count)

    def sort_keys(self, columns: Any) -> list[float]:
        return columns[:, 0].astype(np.int64).astype(float).tolist()
