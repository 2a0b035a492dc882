"""User-facing configuration of an `ImpressStore`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ConfigError

_SELECTIONS = ("token", "block")
_DECODES = ("full", "keep")
_KV_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class ImpressConfig:
    """Parameters of a store and of the caches it hands out.

    Every field is validated when the object is created; a value out of range raises
    `ConfigError` naming the field, the value and what is
    allowed.

    Parameters
    ----------
    chunk_tokens:
        Tokens per disk block. All K and V rows of one layer and one block are stored
        contiguously, so this is the unit of disk I/O. The paper uses 64.
    important_ratio:
        Share of a reused prefix whose K/V is loaded for the prefill of new tokens.
        ``1.0`` loads the whole prefix and reproduces uncached generation exactly.
    probe_heads:
        Query heads per layer used to find the important prefix tokens. They are taken
        from different KV groups; the store keeps a compact copy of their KV heads' keys.
    probe_dtype:
        Encoding of that probe-key copy: ``"int8"`` (default), ``"int4"`` or
        ``"float16"``. Fixed when a store is created.
    similarity_alpha:
        Exponent of the probe-head agreement threshold ``t = j ** alpha``.
    similarity_threshold:
        Fixed threshold that overrides ``similarity_alpha`` when set.
    selection:
        ``"token"`` (top-k rows, read the blocks holding them) or ``"block"`` (rank
        whole blocks by their summed probe scores).
    decode:
        ``"full"`` decodes against the whole prefix, ``"keep"`` against the selected
        rows only.
    kv_dtype:
        Dtype of the K/V rows on disk. ``"auto"`` keeps the model's dtype, which is
        what exact reuse needs.
    io_threads:
        Threads issuing ``preadv`` requests in parallel (requests in flight).
    device_bytes, host_bytes, disk_bytes:
        Byte budgets of the device tier, the host tier and the store on disk
        (``None``: unbounded disk).
    policy:
        Eviction policy of the memory tiers: ``"score"``, ``"lru"`` or ``"lfu"``.
    tier_shares:
        Shares of each memory tier preallocated to high, medium and low importance
        blocks.
    fsync:
        Flush chunk files and the directory to the device before a write is
        committed to the index. Turning it off trades crash safety for speed.
    """

    chunk_tokens: int = 64
    important_ratio: float = 1.0
    probe_heads: int = 3
    probe_dtype: str = "int8"
    similarity_alpha: float = 0.6
    similarity_threshold: float | None = None
    selection: str = "block"
    decode: str = "full"
    kv_dtype: str = "auto"
    io_threads: int = 8
    device_bytes: int = 256 * 2**20
    host_bytes: int = 1024 * 2**20
    disk_bytes: int | None = None
    policy: str = "score"
    tier_shares: dict[str, float] = field(
        default_factory=lambda: {"high": 0.3, "medium": 0.5, "low": 0.2}
    )
    fsync: bool = True

    def __post_init__(self) -> None:
        _check_int(self, "chunk_tokens", 1, 1 << 16)
        if not isinstance(self.important_ratio, (int, float)) or not (
            0.0 < float(self.important_ratio) <= 1.0
        ):
            raise ConfigError(
                f"important_ratio must be a number in (0, 1], got {self.important_ratio!r}"
            )
        _check_int(self, "probe_heads", 1, 1024)
        if not (0.0 < float(self.similarity_alpha) <= 10.0):
            raise ConfigError(
                f"similarity_alpha must be in (0, 10], got {self.similarity_alpha!r}"
            )
        if self.similarity_threshold is not None and not (
            0.0 <= float(self.similarity_threshold) <= 1.0
        ):
            raise ConfigError(
                "similarity_threshold must be None or in [0, 1], "
                f"got {self.similarity_threshold!r}"
            )
        _check_choice(self, "selection", _SELECTIONS)
        _check_choice(self, "probe_dtype", ("float16", "int8", "int4"))
        _check_choice(self, "decode", _DECODES)
        _check_choice(self, "kv_dtype", _KV_DTYPES)
        _check_int(self, "io_threads", 1, 256)
        _check_int(self, "device_bytes", 0, None)
        _check_int(self, "host_bytes", 0, None)
        if self.disk_bytes is not None:
            _check_int(self, "disk_bytes", 1, None)
        if not isinstance(self.policy, str) or not self.policy:
            raise ConfigError(f"policy must be a policy name, got {self.policy!r}")
        shares = self.tier_shares
        if set(shares) != {"high", "medium", "low"} or any(
            not isinstance(v, (int, float)) or v < 0 for v in shares.values()
        ):
            raise ConfigError(
                "tier_shares must map 'high', 'medium' and 'low' to non-negative "
                f"numbers, got {shares!r}"
            )
        if abs(sum(shares.values()) - 1.0) > 1e-6:
            raise ConfigError(f"tier_shares must sum to 1, got {sum(shares.values())}")

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dictionary."""
        return asdict(self)


def _check_int(cfg: ImpressConfig, name: str, lo: int, hi: int | None) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        upper = "" if hi is None else f" and <= {hi}"
        raise ConfigError(f"{name} must be >= {lo}{upper}, got {value}")


def _check_choice(cfg: ImpressConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
