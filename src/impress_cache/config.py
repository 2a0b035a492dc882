"""User-facing configuration of an `ImpressStore`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ConfigError
from .probe import ENCODINGS
from .selection.modes import BLOCK_SCORES, SELECTION_MODES
from .storage.kv_codec import check_supported
from .tiers.policies import POLICIES
from .tiers.policies.score import DEFAULT_UNIMPORTANT_WEIGHT
from .validate import (
    check_choice,
    check_class_shares,
    check_file_mode,
    check_int,
    check_number,
    check_remote,
    check_seconds,
    check_unit,
    is_number,
)

_DECODES = ("full", "keep")
#: read-ahead of a sparse prefill (``prefetch``; ``True`` is ``"next"``)
PREFETCH_MODES = ("next", "agreed")
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
        Share of a reused prefix whose K/V is loaded for the prefill of new tokens, or
        ``"auto"`` (default): per request, exact reuse or sparse loading at
        ``auto_ratio`` (or a larger ratio where it is predicted nearly free), whichever
        the store's cost model predicts gives the first token sooner (measured bandwidth
        of where the blocks are, this machine's selection and compute cost, the prefix
        length and the number of new tokens; see docs: Time to first token). A fast local
        disk, the page cache and the memory tiers get exact reuse; a slow disk or a
        remote tier gets sparse loading. ``RequestStats.plan`` reports the choice. A
        number keeps that ratio for every request: ``1.0`` loads the whole prefix and
        reproduces uncached generation exactly.
    auto_ratio:
        The ratio of sparse loading when ``important_ratio="auto"`` chooses it (and the
        share of rows importance reordering packs for). The default 0.2 (the paper uses
        0.25) with the new tokens recomputed after the prefill and the uncertainty guard
        kept greedy answers identical to dense reuse's in the answers benchmark
        (``results/answers-20q.json``) while reading 0.32-0.43 of the prefix before the
        first token (docs: Sparse loading).
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
    block_scores:
        How ``"block"`` and ``"token"`` selection score the prefix with the probe keys.
        ``"rows"``: every prefix row with every query head of the probed KV groups
        (softmax column sums; costs about what the layer's attention costs).
        ``"bounds"``: every unit (the part of a stored block the prefix covers) by an
        upper bound of ``q . k`` over its keys from their per-channel minimum and maximum
        (Quest-style; about ``P / chunk_tokens`` summaries per layer instead of ``P``
        rows); its rows share the unit's score. The summaries are computed from the
        decoded probe copy on the loader thread, ahead of the layers.
    decode:
        ``"full"`` decodes against the whole prefix, ``"keep"`` against the selected
        rows only.
    refresh_new_tokens:
        Sparse prefills with ``decode="full"``: once the whole prefix is restored (before
        the first decode step), compute the new tokens' K/V again against it, so that
        every later token sees exactly what dense reuse would hold (the prefill computed
        them against the selected rows only). Costs one forward of the new tokens after
        the first token; no extra bytes (docs: Sparse loading, "Answers").
    guard_margin:
        Uncertainty guard of sparse prefills, in nats: when the gap between the two most
        likely first tokens of the sparse prefill is below it (any batch row), the whole
        prefix is read and the new tokens recomputed against it *before* the first token
        is emitted, which then equals dense reuse. ``decode="full"`` only (``"keep"``
        reads nothing more). ``0`` disables the guard. The default 0.5 was chosen on the
        tuning half of the answers benchmark, where the sparse prefill's wrong first
        tokens had gaps of 0.33 to 0.75 nats.
    keep_sinks, keep_recent:
        Prefix rows always selected in every layer of a sparse prefill: the first
        ``keep_sinks`` (attention sinks) and the last ``keep_recent`` (the text just
        before the question). They count against ``k``.
    keep_reselect:
        ``decode="keep"`` only: before the first decode step every layer chooses its
        ``k`` prefix rows again per token and KV head with the new tokens' queries and
        their K/V are computed again over those rows; then every ``keep_reselect``
        generated tokens each layer chooses again with the latest token's queries,
        reading the blocks of rows it does not hold (the encoded probe copies stay in
        memory). A layer still holds ``k`` prefix rows. ``0`` (default) keeps the
        prefill's choice. ``1`` lifted same-position agreement at 2k from 0.566 to 0.767
        on the answers benchmark's held-apart texts, at about half of the prefix's bytes
        read per generated token (docs: Sparse loading); ``4`` did no better than ``0``.
    keep_reselect_decay:
        With ``keep_reselect``: a re-selection ranks the rows by this token's share of
        the probe heads' attention plus ``keep_reselect_decay`` times the previous
        ranking of the layer, so rows that mattered to the last few tokens tend to
        stay. Chosen on the tuning texts, where 0.5 (default) read 24 % fewer bytes than
        0 with the same answers (0.8: 46 % fewer, slightly lower agreement); held apart
        it read 25 % fewer and agreed 0.01 less.
    kv_dtype:
        Dtype of the K/V rows on disk. ``"auto"`` keeps the model's dtype, which is
        what exact reuse needs.
    kv_codec:
        How K/V blocks are kept on disk: ``None`` (default) in ``kv_dtype``, and reuse
        at ``important_ratio=1.0`` is bit-exact; ``"int8"`` or ``"fp8"`` (float8 e4m3)
        stores one byte per value plus a float32 scale per token, head and K or V
        (0.27x the bytes of float32 at head_dim 64), decoded to ``kv_dtype`` when read.
        With a codec reuse is close, not exact (docs: Configuration). Fixed when a store
        is created: opening it with another codec raises `ConfigError`.
    io_threads:
        Threads issuing ``preadv`` requests in parallel (requests in flight).
    direct_io:
        How exact reuse from disk reads its blocks straight into a layer's buffer (the
        memory tiers off, no ``kv_codec``): ``True`` with ``O_DIRECT`` (no copy from
        the page cache and no page-cache bookkeeping; the device is read even where the
        blocks are cached); ``False`` through the page cache; ``"auto"`` (default)
        with ``O_DIRECT`` unless most of a layer's range of a file is in the page cache
        (Linux ``cachestat``; without it, like ``True``). A file system that refuses
        ``O_DIRECT`` is read through the page cache (docs: Performance).
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
        ``impress_cache.tiers.policies.POLICIES``: ``"score"`` (IMPRESS: decayed access
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
    prefetch:
        Sparse prefills only: once a layer has chosen its blocks, start reading blocks of
        the next layer (adjacent layers select largely the same ones), so that the next
        layer finds most of its rows read; what it chose besides is read then. ``True``
        (or ``"next"``): the blocks this layer chose; ``"agreed"``: the blocks both this
        layer and the one before chose (fewer wrong guesses: in the TTFT benchmark about
        half the bytes read in vain, with 0.58-0.70 instead of 0.71-0.79 of the needed
        blocks found read at 1k, 2k and 8k tokens; docs: Time to first token). Blocks read this way but not chosen count as invalid I/O
        (and, with ``decode="full"``, are not read again for decoding). Off by default:
        in the answers benchmark those blocks were 0.07 to 0.13 of the prefix's bytes
        read before the first token at 1k-2k tokens (docs: Sparse loading).
    file_mode:
        Permission bits of the store's files (``0o600``, the default: only the owner
        can read the K/V, from which prompts can be reconstructed). Directories get the
        same bits plus search (``x``) where reading is allowed, so ``0o640`` lets a
        serving group read the store. Applied to what the store creates from now on.
    remote:
        URL of a remote tier shared with other hosts (``"s3://bucket/prefix"``; docs:
        Several hosts), or ``None`` (default) for a store on this host only. Stored
        prompts are uploaded in the background; a prompt not stored locally is looked up
        there and its stored prefix linked into the local store, its blocks fetched with
        ranged reads when they are read.
    remote_options:
        Options for the remote client (s3fs): ``key``, ``secret``, ``client_kwargs``
        (``endpoint_url``, ``region_name``), ``connect_timeout``, ``read_timeout``,
        ``retries``.
    remote_bytes:
        Byte budget of this model's objects in the remote tier (``None``: unbounded);
        after an upload that takes it over, the least recently used objects older than
        ``remote_grace_s`` are deleted.
    remote_grace_s:
        Age (by the server's clock) below which a remote object is never deleted, so a
        host that has just found it can still read it.
    remote_retry_s:
        How long a failed upload is retried in the background before it is dropped with
        a warning (the local store keeps the prompt).
    remote_key_tokens:
        Spacing of the lookup keys of a stored prompt (prefix lengths 16, 32, ... below
        it, then its multiples). A host reuses a remote prefix only up to the last key
        it shares with the stored prompt plus what the manifest behind that key shares.
    stats_interval_s:
        Block statistics (frequency, importance share, last access) are written to the
        index on `flush`, on `close` and, while requests run, at most every
        ``stats_interval_s`` seconds (in the background). ``None``: only on flush and
        close.
    write_wait_s:
        A lookup whose prompt a write still in flight (a prompt handed to the background
        writer, not committed yet) would match further than the committed index waits
        for that write to commit, at most this many seconds, and then matches (the
        request's ``stats.waited_for_write_seconds``). A write that fails ends the wait
        (nothing more matched). ``0`` never waits.
    reorg_idle_ms:
        Importance reordering: a background thread rewrites nodes whose statistics call
        for a new row order once the store has been idle this long, and waits for this
        much idleness again before every block it writes. ``None``: no background
        rewrites (`ImpressStore.reorganize` and ``impress-cache reorg`` still work).
    reorg_min_requests:
        Sparse requests a node must gather since its order was last decided before the
        reorganiser looks at it again.
    reorg_min_gain:
        A node is rewritten when its top ``important_ratio`` rows would need at least
        this share fewer blocks afterwards (docs: Importance reordering).
    """

    chunk_tokens: int = 16
    important_ratio: float | str = "auto"
    auto_ratio: float = 0.2
    probe_heads: int = 3
    probe_dtype: str = "int4"
    similarity_alpha: float = 0.6
    similarity_threshold: float | None = None
    selection: str = "block"
    block_scores: str = "rows"
    decode: str = "full"
    refresh_new_tokens: bool = True
    guard_margin: float = 0.5
    keep_sinks: int = 0
    keep_recent: int = 0
    keep_reselect: int = 0
    keep_reselect_decay: float = 0.5
    kv_dtype: str = "auto"
    kv_codec: str | None = None
    io_threads: int = 8
    direct_io: bool | str = "auto"
    device_bytes: int = 256 * 2**20
    host_bytes: int = 1024 * 2**20
    disk_bytes: int | None = None
    policy: str = "score"
    tier_shares: dict[str, float] = field(
        default_factory=lambda: {"high": 0.3, "medium": 0.5, "low": 0.2}
    )
    fsync: bool = True
    half_life_s: float | None = 600.0
    unimportant_weight: float = DEFAULT_UNIMPORTANT_WEIGHT
    stats_interval_s: float | None = 60.0
    prefetch: bool | str = False
    reorg_idle_ms: float | None = 50.0
    reorg_min_requests: int = 4
    reorg_min_gain: float = 0.2
    file_mode: int = 0o600
    remote: str | None = None
    remote_options: dict[str, Any] = field(default_factory=dict)
    remote_bytes: int | None = None
    remote_grace_s: float = 600.0
    remote_retry_s: float = 30.0
    remote_key_tokens: int = 256
    write_wait_s: float = 5.0

    def __post_init__(self) -> None:
        check_int("chunk_tokens", self.chunk_tokens, 1, 1 << 16)
        if isinstance(self.important_ratio, str):
            if self.important_ratio != "auto":
                raise ConfigError(f'important_ratio must be "auto" or a number in (0, 1], got {self.important_ratio!r}')
        else:
            check_unit("important_ratio", self.important_ratio, open_low=True)
        check_unit("auto_ratio", self.auto_ratio, open_low=True)
        check_int("probe_heads", self.probe_heads, 1, 1024)
        if not is_number(self.similarity_alpha) or not (0.0 < float(self.similarity_alpha) <= 10.0):
            raise ConfigError(f"similarity_alpha must be in (0, 10], got {self.similarity_alpha!r}")
        if self.similarity_threshold is not None:
            check_unit("similarity_threshold", self.similarity_threshold)
        check_choice("selection", self.selection, SELECTION_MODES)
        check_choice("block_scores", self.block_scores, BLOCK_SCORES)
        check_choice("probe_dtype", self.probe_dtype, ENCODINGS)
        check_choice("decode", self.decode, _DECODES)
        check_choice("kv_dtype", self.kv_dtype, _KV_DTYPES)
        if self.kv_codec is not None:
            try:  # (one of `KV_CODECS`, and one this torch converts on the CPU)
                check_supported(self.kv_codec)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        check_number("guard_margin", self.guard_margin, 0.0, 100.0)
        check_int("keep_sinks", self.keep_sinks, 0)
        check_int("keep_recent", self.keep_recent, 0)
        check_int("keep_reselect", self.keep_reselect, 0)
        check_number("keep_reselect_decay", self.keep_reselect_decay, 0.0, 1.0)
        check_int("io_threads", self.io_threads, 1, 256)
        if self.direct_io not in (True, False, "auto") or not isinstance(self.direct_io, (bool, str)):
            raise ConfigError(f'direct_io must be True, False or "auto", got {self.direct_io!r}')
        if not isinstance(self.prefetch, bool):
            check_choice("prefetch", self.prefetch, PREFETCH_MODES)
        for name in ("fsync", "refresh_new_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_int("device_bytes", self.device_bytes, 0)
        check_int("host_bytes", self.host_bytes, 0)
        if self.disk_bytes is not None:
            check_int("disk_bytes", self.disk_bytes, 1)
        if not isinstance(self.policy, str) or self.policy.lower() not in POLICIES:
            raise ConfigError(
                f"policy must be one of {', '.join(map(repr, sorted(POLICIES)))} "
                f"(the names registered in impress_cache.tiers.policies.POLICIES), got {self.policy!r}"
            )
        check_class_shares("tier_shares", self.tier_shares)
        check_unit("unimportant_weight", self.unimportant_weight)
        check_seconds("half_life_s", self.half_life_s)
        check_seconds("stats_interval_s", self.stats_interval_s)
        if self.reorg_idle_ms is not None and (
            not is_number(self.reorg_idle_ms) or not 0.0 <= float(self.reorg_idle_ms) < math.inf
        ):
            raise ConfigError(f"reorg_idle_ms must be None or a number of milliseconds >= 0, got {self.reorg_idle_ms!r}")
        check_int("reorg_min_requests", self.reorg_min_requests, 1)
        check_unit("reorg_min_gain", self.reorg_min_gain)
        check_file_mode("file_mode", self.file_mode)
        check_remote(self.remote, self.remote_options)
        if self.remote_bytes is not None:
            check_int("remote_bytes", self.remote_bytes, 1)
        for name in ("remote_grace_s", "remote_retry_s", "write_wait_s"):
            if not is_number(getattr(self, name)) or not 0.0 <= float(getattr(self, name)) < math.inf:
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {getattr(self, name)!r}")
        check_int("remote_key_tokens", self.remote_key_tokens, 16, 1 << 20)

    @property
    def auto(self) -> bool:
        """Whether each request chooses between exact reuse and sparse loading."""
        return self.important_ratio == "auto"

    @property
    def sparse_ratio(self) -> float:
        """The ratio sparse loading uses: ``important_ratio``, or ``auto_ratio`` with "auto"."""
        return self.auto_ratio if self.auto else float(self.important_ratio)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dictionary."""
        return asdict(self)

