"""Least-recently-used policy."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from .base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evict the block whose last access is the oldest.

    The priority is the policy's access counter at the block's last access (a
    monotonic sequence number, so equal clock readings still order correctly). Seeding
    a block (admission without an access) counts as a use. Importance shares are
    tracked only to give the block an importance class.
    """

    name = "lru"

    def priority(self, key: Hashable, now: float) -> float:
        """Sequence number of the last access; lower is older."""
        return float(self._get(key).seq)

    def sort_keys(self, columns: Any) -> list[float]:
        return columns[:, 3].astype(np.int64).astype(float).tolist()
