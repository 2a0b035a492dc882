"""IMPRESS score policy: decayed access frequency x average important share."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from ...validate import check_seconds, check_unit
from .base import BlockStats, EvictionPolicy

#: default ``w`` of `ScorePolicy` (and of ``ImpressConfig.unimportant_weight``)
DEFAULT_UNIMPORTANT_WEIGHT = 0.1


class ScorePolicy(EvictionPolicy):
    """Evict the block with the lowest ``frequency x (w + (1 - w) x important share)``.

    ``frequency`` counts accesses with exponential time decay: every access adds 1 and
    the total halves every ``half_life_s`` seconds, so a block that was hot long ago
    loses its place to blocks in use now. ``important share`` is the moving average
    of the fraction of the block's rows that requests marked important (IMPRESS,
    section 3).

    Parameters
    ----------
    half_life_s:
        Half-life of the frequency, in seconds of the manager's clock. ``None`` or
        ``math.inf`` disables decay (plain access count, as in the paper).
    unimportant_weight:
        ``w``: what a row that requests read but did not select is worth, relative to
        an important row. ``0`` is the paper's score (only important rows count). With
        ``decode="full"`` every row of a reused prefix is read, the unselected ones
        after the prefill; ``w > 0`` lets blocks of hot prefixes that are rarely
        selected stay in memory, trading some important-row hits for fewer bytes read
        in total.
    share_ema, high_threshold, low_threshold:
        See `EvictionPolicy`.

    Notes
    -----
    Decay is lazy: a block stores ``freq`` and the time ``freq_time`` it was last
    brought up to date, and ``freq(now) = freq * 2 ** (-(now - freq_time) / half_life)``.
    Because every block decays by the same factor over the same interval, the order of
    blocks that are not accessed never changes. `sort_key` exploits this: it is
    ``log2(freq * share) + freq_time / half_life``, which equals
    ``log2(priority(now)) + now / half_life`` for every ``now``, so it orders blocks
    exactly as the current score does and heap entries only go stale when a block is
    accessed.
    """

    name = "score"
    time_invariant_order = True

    def __init__(
        self,
        *,
        half_life_s: float | None = 600.0,
        share_ema: float = 0.5,
        high_threshold: float = 0.5,
        low_threshold: float = 0.2,
        unimportant_weight: float = DEFAULT_UNIMPORTANT_WEIGHT,
    ) -> None:
        super().__init__(
            share_ema=share_ema, high_threshold=high_threshold, low_threshold=low_threshold
        )
        half_life = check_seconds("half_life_s", half_life_s)
        self.half_life_s = math.inf if half_life is None else half_life
        self.unimportant_weight = check_unit("unimportant_weight", unimportant_weight)

    def _value(self, st: BlockStats) -> float:
        """Worth of one access: the important share, unselected rows weighted by ``w``."""
        w = self.unimportant_weight
        return w + (1.0 - w) * st.share

    def priority(self, key: Hashable, now: float) -> float:
        """Current score ``decayed frequency x (w + (1 - w) x average important share)``."""
        st = self._get(key)
        return self._frequency_at(st, now) * self._value(st)

    def sort_key(self, key: Hashable, now: float) -> tuple[float, int]:
        """Time-invariant key ordering blocks as `priority` does at any time."""
        st = self._get(key)
        product = st.freq * self._value(st)
        if product <= 0.0:
            return (-math.inf, st.seq)
        offset = 0.0 if math.isinf(self.half_life_s) else st.freq_time / self.half_life_s
        return (math.log2(product) + offset, st.seq)

    def sort_keys(self, columns: Any) -> list[float]:
        w = self.unimportant_weight
        product = (columns[:, 1] * (w + (1.0 - w) * columns[:, 2])).tolist()  # as `sort_key` rounds it
        if math.isinf(self.half_life_s):
            offset = [0.0] * len(product)
        else:
            offset = (columns[:, 4] / self.half_life_s).tolist()
        log2, inf = math.log2, -math.inf
        return [log2(p) + o if p > 0.0 else inf for p, o in zip(product, offset)]

    def decayed_frequency(self, key: Hashable, now: float) -> float:
        """Access frequency of the block decayed to ``now``."""
        return self._frequency_at(self._get(key), now)

    def _frequency_at(self, st: BlockStats, now: float) -> float:
        if st.freq == 0.0 or math.isinf(self.half_life_s):
            return st.freq
        dt = max(0.0, now - st.freq_time)
        return st.freq * math.pow(2.0, -dt / self.half_life_s)

    def _bump_frequency(self, st: BlockStats, now: float) -> None:
        # Never move freq_time backwards: a clock that steps back must not inflate
        # the frequency.
        when = max(now, st.freq_time)
        st.freq = self._frequency_at(st, when) + 1.0
        st.freq_time = when
