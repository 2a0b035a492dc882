"""One check per kind of knob, shared by `ImpressConfig` and the components it configures.

Every value a user can set is checked by exactly one of these functions, so the same
knob gives the same error wherever it is passed (a config field, a policy constructor,
the tier manager). Each raises `ConfigError` naming the knob, the value and what is
allowed. No torch here: the tier package uses these too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

#: importance classes of the memory tiers, from most to least important
IMPORTANCE_CLASSES: tuple[str, str, str] = ("high", "medium", "low")


def is_number(value: object) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """An integer in ``[lo, hi]`` (``hi=None``: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        upper = "" if hi is None else f" and <= {hi}"
        raise ConfigError(f"{name} must be >= {lo}{upper}, got {value}")
    return value


def check_unit(name: str, value: Any, *, open_low: bool = False) -> float:
    """A number in ``[0, 1]`` (``(0, 1]`` with ``open_low``)."""
    if not is_number(value) or math.isnan(float(value)):
        raise ConfigError(f"{name} must be a number in {'(' if open_low else '['}0, 1], got {value!r}")
    v = float(value)
    if v > 1.0 or v < 0.0 or (open_low and v == 0.0):
        raise ConfigError(f"{name} must be a number in {'(' if open_low else '['}0, 1], got {value!r}")
    return v


def check_number(name: str, value: Any, lo: float, hi: float) -> float:
    """A finite number in ``[lo, hi]``."""
    if not is_number(value) or not lo <= float(value) <= hi:
        raise ConfigError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def check_seconds(name: str, value: Any) -> float | None:
    """``None`` or a positive number of seconds (``math.inf`` allowed)."""
    if value is None:
        return None
    if not is_number(value) or not float(value) > 0.0:
        raise ConfigError(f"{name} must be None or a positive number of seconds, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """One of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def check_class_shares(name: str, shares: Any) -> dict[str, float]:
    """Shares of ``high``, ``medium`` and ``low``: non-negative numbers summing to 1."""
    if (
        not isinstance(shares, Mapping)
        or set(shares) != set(IMPORTANCE_CLASSES)
        or any(not is_number(v) or not float(v) >= 0.0 for v in shares.values())
    ):
        raise ConfigError(
            f"{name} must map 'high', 'medium' and 'low' to non-negative numbers, got {shares!r}"
        )
    total = sum(float(v) for v in shares.values())
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ConfigError(f"{name} must sum to 1, got {total} for {dict(shares)!r}")
    return {c: float(shares[c]) for c in IMPORTANCE_CLASSES}


def check_file_mode(name: str, value: Any) -> int:
    """Permission bits of the store's files: read and write for the owner, at most read
    and write for group and others (no execute, setuid or sticky bits), e.g. ``0o600``
    or ``0o640``."""
    if isinstance(value, bool) or not isinstance(value, int) or value & ~0o666 or value & 0o600 != 0o600:
        shown = oct(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        raise ConfigError(
            f"{name} must be permission bits that give the owner read and write and others at most read and "
            f"write (0o600, 0o640, 0o660, 0o644 ...), got {shown}"
        )
    return value
