"""Interface shared by the eviction policies of the memory tiers.

A policy keeps per-block statistics (access count, a frequency that may decay, a moving
average of the block's important share, last access) and turns them into an eviction
sort key: the lower the key, the earlier the block is evicted. A policy never moves data
and knows nothing about tiers or byte budgets; `TierManager`
does that.

Policies are not thread-safe by themselves: the tier manager calls them under its lock.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ...errors import ConfigError
from ...validate import check_unit

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BlockStats:
    """Statistics of one block, as kept by a policy.

    Attributes
    ----------
    count:
        Number of recorded accesses.
    freq:
        Access frequency as of ``freq_time`` (equal to ``count`` unless the policy
        decays it).
    freq_time:
        Clock value at which ``freq`` was last brought up to date.
    share:
        Moving average of the block's important share, in ``[0, 1]``.
    last_access:
        Clock value of the last access (or of seeding).
    seq:
        Global order of the last access; larger means more recent. Used as the LRU key
        and as the tie-break of every policy.
    """

    count: int = 0
    freq: float = 0.0
    freq_time: float = 0.0
    share: float = 1.0
    last_access: float = 0.0
    seq: int = 0


_UNKNOWN = BlockStats()


class EvictionPolicy(ABC):
    """Base class of eviction policies: per-block statistics and a sort key.

    Parameters
    ----------
    share_ema:
        Weight of the newest observation in the moving average of the important share:
        ``share = share_ema * observed + (1 - share_ema) * share``. The first observation
        of a block sets the average directly.
    high_threshold:
        A block whose average important share is ``>= high_threshold`` is in class
        ``"high"``.
    low_threshold:
        A block whose average important share is ``< low_threshold`` is in class
        ``"low"``; blocks in between are ``"medium"``.

    Notes
    -----
    Statistics of a block the policy has never seen are those of `BlockStats`
    defaults: no accesses, share 1.0 (unknown counts as fully important, hence class
    ``"high"``), ``seq`` 0 (oldest).

    The manager keeps blocks in heaps ordered by `sort_key`. A policy whose
    ``time_invariant_order`` is true promises that ``sort_key`` does not depend on
    ``now`` and that only `on_access`, `seed` and `load_stats`
    change it, so heap entries stay valid until the block's statistics change. A policy
    that cannot promise that sets it to false and the manager recomputes every key
    before it chooses victims.
    """

    #: Registry name of the policy.
    name: ClassVar[str] = "base"
    #: Whether `sort_key` is independent of the clock (see class notes).
    time_invariant_order: ClassVar[bool] = True

    def __init__(
        self,
        *,
        share_ema: float = 0.5,
        high_threshold: float = 0.5,
        low_threshold: float = 0.2,
    ) -> None:
        self.share_ema = check_unit("share_ema", share_ema, open_low=True)
        self.high_threshold = check_unit("high_threshold", high_threshold)
        self.low_threshold = check_unit("low_threshold", low_threshold)
        if self.low_threshold > self.high_threshold:
            raise ConfigError(
                f"low_threshold ({low_threshold}) must be <= high_threshold "
                f"({high_threshold})"
            )
        self._stats: dict[Hashable, BlockStats] = {}
        self._tick = 0

    # ------------------------------------------------------------------ updates
    def on_access(
        self, key: Hashable, now: float, important_share: float | None = None
    ) -> None:
        """Record that a request used the block (hit or miss).

        Parameters
        ----------
        key:
            Block identifier.
        now:
            Current clock value, in seconds.
        important_share:
            Fraction of the block's rows that the request's selection marked important,
            in ``[0, 1]``; ``None`` means unknown and counts as 1.0. Values outside the
            range are clipped.
        """
        share = self._clip_share(important_share)
        st = self._stats.get(key)
        if st is None:
            st = BlockStats(freq_time=now, share=share, last_access=now)
            self._stats[key] = st
        else:
            st.share = self.share_ema * share + (1.0 - self.share_ema) * st.share
        self._tick += 1
        st.count += 1
        st.last_access = now
        st.seq = self._tick
        self._bump_frequency(st, now)

    def seed(self, key: Hashable, now: float, important_share: float | None = None) -> bool:
        """Create statistics for a block without counting an access.

        Does nothing when the block already has statistics.

        Returns
        -------
        bool
            True when statistics were created.
        """
        if key in self._stats:
            return False
        self._tick += 1
        self._stats[key] = BlockStats(
            freq_time=now,
            share=self._clip_share(important_share),
            last_access=now,
            seq=self._tick,
        )
        return True

    def forget(self, key: Hashable) -> None:
        """Drop the statistics of a block (no error if there are none)."""
        self._stats.pop(key, None)

    # ------------------------------------------------------------------ ordering
    @abstractmethod
    def priority(self, key: Hashable, now: float) -> float:
        """Eviction priority of the block at time ``now``; lower is evicted first."""

    def sort_key(self, key: Hashable, now: float) -> tuple[float, int]:
        """Total order used by the manager's heaps: ``(priority, seq)``.

        Orders blocks exactly as `priority` at time ``now``, ties broken by last
        access (least recent first). Subclasses whose priority changes with time
        override this with a time-invariant equivalent (see `ScorePolicy`).
        """
        return (self.priority(key, now), self._get(key).seq)

    def sort_keys(self, columns: Any) -> list[float] | None:
        """The first elements of `sort_key` (a list) for statistics not loaded yet, given as
        columns (``float64 [n, 6]`` of ``count, freq, share, seq, freq_time,
        last_access``, as `load_columns` takes them): what `sort_key` gives once each
        row is loaded (up to rounding; the second element is ``seq``). ``None`` when the
        policy has no column form (its rows are then loaded one by one)."""
        return None

    # ------------------------------------------------------------------ importance
    def importance_share(self, key: Hashable) -> float:
        """Moving average of the block's important share (1.0 if unknown)."""
        return self._get(key).share

    def importance_class(self, key: Hashable) -> str:
        """Importance class of the block: ``"high"``, ``"medium"`` or ``"low"``."""
        share = self._get(key).share
        if share >= self.high_threshold:
            return "high"
        if share < self.low_threshold:
            return "low"
        return "medium"

    # ------------------------------------------------------------------ persistence
    def stats_of(self, key: Hashable, now: float | None = None) -> dict[str, Any]:
        """Statistics of a block as a JSON-serialisable dictionary.

        Parameters
        ----------
        key:
            Block identifier.
        now:
            When given, ``freq`` is brought up to date (decayed) to ``now``,
            ``freq_time`` is set to ``now`` and ``age_s = now - last_access`` is added,
            which makes the record independent of the clock origin (monotonic clocks
            restart with the process). Pass the same ``now`` to `load_stats`.

        Returns
        -------
        dict
            Keys ``count``, ``freq``, ``freq_time``, ``share``, ``last_access``, ``seq``
            and, with ``now``, ``age_s``. An unknown block gives the defaults.
        """
        st = self._get(key)
        out: dict[str, Any] = {
            "count": st.count,
            "freq": st.freq,
            "freq_time": st.freq_time,
            "share": st.share,
            "last_access": st.last_access,
            "seq": st.seq,
        }
        if now is not None:
            out["freq"] = self._frequency_at(st, now)
            out["freq_time"] = now
            out["age_s"] = max(0.0, now - st.last_access)
        return out

    def load_stats(
        self, key: Hashable, stats: Mapping[str, Any], now: float | None = None
    ) -> None:
        """Install statistics previously returned by `stats_of`.

        Missing fields take their defaults. With ``now``, timestamps are rebased: the
        frequency is taken as of ``now`` and ``last_access = now - age_s`` (or ``now``
        when the record has no ``age_s``). The policy's access counter is advanced past
        the loaded ``seq`` so later accesses stay more recent.

        Raises
        ------
        ConfigError
            If a field is out of range (negative count or frequency, share outside
            ``[0, 1]``).
        """
        count = int(stats.get("count", 0))
        freq = float(stats.get("freq", count))
        share = float(stats.get("share", 1.0))
        if count < 0 or not freq >= 0.0 or not (0.0 <= share <= 1.0):
            raise ConfigError(
                f"invalid statistics for block {key!r}: count={count}, freq={freq}, "
                f"share={share}; expected count >= 0, freq >= 0, 0 <= share <= 1"
            )
        seq = int(stats.get("seq", 0))
        if now is None:
            freq_time = float(stats.get("freq_time", 0.0))
            last_access = float(stats.get("last_access", freq_time))
        else:
            freq_time = float(now)
            last_access = float(now) - float(stats.get("age_s", 0.0))
        self._stats[key] = BlockStats(
            count=count,
            freq=freq,
            freq_time=freq_time,
            share=share,
            last_access=last_access,
            seq=seq,
        )
        self._tick = max(self._tick, seq)

    # ------------------------------------------------------------------ container
    def load_columns(
        self, keys: list[Hashable], count: list[int], freq: list[float], share: list[float], seq: list[int],
        freq_time: list[float], last_access: list[float],
    ) -> None:
        """`load_stats` without ``now`` for many blocks at once, from columns whose
        values the caller has checked (count >= 0, freq >= 0, 0 <= share <= 1)."""
        stats = self._stats
        for k, c, f, sh, q, ft, la in zip(keys, count, freq, share, seq, freq_time, last_access):
            stats[k] = BlockStats(c, f, ft, sh, la, q)
        if seq:
            self._tick = max(self._tick, max(seq))

    def __contains__(self, key: object) -> bool:
        return key in self._stats

    def __len__(self) -> int:
        return len(self._stats)

    def keys(self) -> Iterator[Hashable]:
        """Blocks that have statistics."""
        return iter(list(self._stats))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(blocks={len(self._stats)})"

    # ------------------------------------------------------------------ helpers
    def _get(self, key: Hashable) -> BlockStats:
        return self._stats.get(key, _UNKNOWN)

    @staticmethod
    def _clip_share(important_share: float | None) -> float:
        if important_share is None:
            return 1.0
        share = float(important_share)
        if math.isnan(share):
            return 1.0
        return min(1.0, max(0.0, share))

    def _bump_frequency(self, st: BlockStats, now: float) -> None:
        """Add one access to the frequency (no decay in the base class)."""
        st.freq += 1.0
        st.freq_time = now

    def _frequency_at(self, st: BlockStats, now: float) -> float:
        """Frequency of ``st`` as of ``now`` (no decay in the base class)."""
        return st.freq
