"""What differs between the transformers versions this package supports.

transformers 5.24 renamed the cache argument of every forward, ``generate`` and mask
helper from ``past_key_values`` to ``cache`` (the old name still works, with a warning,
until 5.40 / 6.0). Hooks see the arguments as the caller passed them, so they look for
both names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: keyword names under which a forward or ``generate`` may receive the cache, newest first
CACHE_KWARGS = ("cache", "past_key_values")


def cache_argument(kwargs: Mapping[str, Any]) -> Any:
    """The cache a call received, under either name (``None`` if none)."""
    for name in CACHE_KWARGS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None
