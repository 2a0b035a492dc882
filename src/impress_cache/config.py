"""User-facing configuration of an `ImpressStore`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ConfigError
from .policies import POLICIES

_SELECTIONS = ("token", "block", "random", "recent", "h2o")
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
        contiguously, so this is the unit of disk I/O and of block selection. The
        paper uses 64; the default 16 gives sparse prefills a 3.5x lower first-token KL
        divergence than 64 for the same bytes on SmolLM2 (docs: Sparse loading), at
        the price of more, smaller reads.
    important_ratio:
        Share of a reused prefix whose K/V is loaded for the prefill of new tokens
        (default 0.25, the paper's setting). ``1.0`` loads the whole prefix and
        reproduces uncached generation exactly.
    probe_heads:
        Probe query heads per layer, taken from different KV groups. Their groups' KV
        heads are the probed ones: the store keeps a compact copy of those keys, and
        every query head of those groups scores the prefix (with grouped-query
        attention the I/O cost is per KV head). Fixed when a store is created.
    probe_dtype:
        Encoding of that probe-key copy: ``"int4"`` (default), ``"int8"`` or
        ``"float16"``. Fixed when a store is created. See the fidelity benchmark for
        what each costs in bytes and selection quality.
    similarity_alpha:
        Exponent of the probe-head agreement threshold ``t = j ** alpha``.
    similarity_threshold:
        Fixed threshold that overrides ``similarity_alpha`` when set.
    selection:
        ``"block"`` (default: rank whole blocks by their summed probe scores and take
        blocks until ``k`` rows are covered) or ``"token"`` (top-k rows, read the blocks
        holding them). ``"random"``, ``"recent"`` (sinks + most recent rows) and ``"h2o"``
        (read all keys, top-k by accumulated attention) are same-budget baselines for
        benchmarks.
    decode:
        ``"full"`` decodes against the whole prefix, ``"keep"`` against the selected
        rows only.
    kv_dtype:
        Dtype of the K/V rows on disk. ``"auto"`` keeps the model's dtype, which is
        what exact reuse needs.
    io_threads:
        Threads issuing ``preadv`` requests in parallel (requests in flight).
    device_bytes, host_bytes:
        Byte budgets of the two memory tiers that cache K/V blocks: the device tier
        (on the model's device; on a CPU-only machine a separately budgeted CPU
        cache) and the host tier (CPU memory, pinned when CUDA is available). ``0``
        disables a tier.
    disk_bytes:
        Byte budget of the chunk files on disk (``None``: unbounded). After a write
        that takes the store over it, whole stored prefixes (radix-tree leaves) with
        the lowest value are removed, never one in use.
    policy:
        Eviction policy of the memory tiers, a name registered in
        ``impress_cache.policies.POLICIES``: ``"score"`` (IMPRESS: decayed access
        frequency x important share, see ``unimportant_weight``), ``"lru"`` or
        ``"lfu"``.
    tier_shares:
        Shares of each memory tier preallocated to high, medium and low importance
        blocks.
    fsync:
        Flush chunk files and the directory to the device before a write is
        committed to the index. Turning it off trades crash safety for speed.
    half_life_s:
        Half-life, in seconds, of the access frequency of the ``"score"`` policy:
        every access adds 1 and the sum halves every ``half_life_s`` seconds, so a
        block that was hot long ago cannot keep its place forever. ``None`` disables
        the decay (plain access counts, as in the paper). Ignored by ``"lru"`` and
        ``"lfu"``.
    unimportant_weight:
        Score policy only: what a block row that a request read but did not select
        counts for, relative to a selected row, in ``[0, 1]``. ``0`` is the paper's
        score, frequency x important share. With ``decode="full"`` requests also read
        their unselected rows (after the prefill); a weight above 0 keeps hot
        prefixes' rarely selected blocks in memory too, so fewer bytes are read in
        total while the important rows still come first. The default 0.1 read 13 %
        fewer bytes than 0 in the workload benchmark for 1 % more before the first
        token (docs: Memory tiers).
    stats_interval_s:
        Block statistics (frequency, importance share, last access) are written to the
        index on `flush`, on `close` and, while requests run, at most every
        ``stats_interval_s`` seconds (in the background). ``None``: only on flush and
        close.
    """

    chunk_tokens: int = 16
    important_ratio: float = 0.25
    probe_heads: int = 3
    probe_dtype: str = "int4"
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
    half_life_s: float | None = 600.0
    unimportant_weight: float = 0.1
    stats_interval_s: float | None = 60.0

    def __post_init__(self) -> None:
        _check_int(self, "chunk_tokens", 1, 1 << 16)
        if not _is_number(self.important_ratio) or not (0.0 < float(self.important_ratio) <= 1.0):
            raise ConfigError(
                f"important_ratio must be a number in (0, 1], got {self.important_ratio!r}"
            )
        _check_int(self, "probe_heads", 1, 1024)
        if not _is_number(self.similarity_alpha) or not (0.0 < float(self.similarity_alpha) <= 10.0):
            raise ConfigError(
                f"similarity_alpha must be in (0, 10], got {self.similarity_alpha!r}"
            )
        if self.similarity_threshold is not None and (
            not _is_number(self.similarity_threshold) or not (0.0 <= float(self.similarity_threshold) <= 1.0)
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
        if not isinstance(self.fsync, bool):
            raise ConfigError(f"fsync must be True or False, got {self.fsync!r}")
        _check_int(self, "device_bytes", 0, None)
        _check_int(self, "host_bytes", 0, None)
        if self.disk_bytes is not None:
            _check_int(self, "disk_bytes", 1, None)
        if not isinstance(self.policy, str) or self.policy.lower() not in POLICIES:
            raise ConfigError(
                f"policy must be one of {', '.join(map(repr, sorted(POLICIES)))} "
                f"(the names registered in impress_cache.policies.POLICIES), got {self.policy!r}"
            )
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
        w = self.unimportant_weight
        if not _is_number(w) or not (0.0 <= float(w) <= 1.0):
            raise ConfigError(f"unimportant_weight must be a number in [0, 1], got {w!r}")
        for name in ("half_life_s", "stats_interval_s"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not float(value) > 0.0
            ):
                raise ConfigError(
                    f"{name} must be None or a positive number of seconds, got {value!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dictionary."""
        return asdict(self)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
