"""Eviction policies of the memory tiers.

A new policy is one new module defining an
`EvictionPolicy` subclass plus one line in
`POLICIES`.
"""

from __future__ import annotations

from typing import Any

from ...validate import IMPORTANCE_CLASSES
from .base import BlockStats, EvictionPolicy
from .lfu import LFUPolicy
from .lru import LRUPolicy
from .score import ScorePolicy

#: Policy classes by registry name.
POLICIES: dict[str, type[EvictionPolicy]] = {
    "score": ScorePolicy,
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
}


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """Instantiate a policy by name.

    Parameters
    ----------
    name:
        Registry name (case-insensitive): ``"score"``, ``"lru"`` or ``"lfu"``.
    **kwargs:
        Passed to the policy's constructor.

    Raises
    ------
    ValueError
        If ``name`` is not registered; the message lists the valid names.
    """
    cls = POLICIES.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        valid = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; valid names: {valid}")
    return cls(**kwargs)


__all__ = [
    "IMPORTANCE_CLASSES",
    "POLICIES",
    "BlockStats",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "ScorePolicy",
    "make_policy",
]
