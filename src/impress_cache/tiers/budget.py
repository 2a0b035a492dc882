"""Byte budgets of the memory tiers, per-class accounting and the choice of victims.

Each tier's budget is split among the importance classes ``high``, ``medium`` and
``low`` (IMPRESS section 4, typically 30/50/20 %). The split is soft and protective:

* a block is admitted without eviction whenever the tier has enough free bytes, even
  if its class is over its share (a class borrows space other classes do not use);
* when space must be freed, victims come only from classes that are over their share
  and from the incoming block's own class, lowest sort key first; "over share" is
  re-evaluated after each victim, so a class stops losing blocks once it is back within
  its share. A burst of low-importance blocks can therefore never evict high-class
  blocks while the high class uses no more than its share;
* blocks of the batch being served (``protected``) are never victims, so admitting one
  block of a request never evicts another block of the same request;
* when the needed bytes cannot be freed this way (or, for competitive admission, only
  by evicting a block with a higher key than the incoming one), admission is refused
  and nothing is evicted. Budgets are never exceeded.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from ..validate import IMPORTANCE_CLASSES
from .heaps import TIERS, HeapItem, Resident, TierHeaps


class TierSpace:
    """Budget, used bytes and per-class bytes of each tier."""

    def __init__(self, budgets: Mapping[str, int], shares: Mapping[str, float]) -> None:
        self.budget = {t: int(budgets[t]) for t in TIERS}
        self.shares = {c: float(shares[c]) for c in IMPORTANCE_CLASSES}
        self.used = {t: 0 for t in TIERS}
        self.class_used = {t: {c: 0 for c in IMPORTANCE_CLASSES} for t in TIERS}
        self.class_count = {t: {c: 0 for c in IMPORTANCE_CLASSES} for t in TIERS}

    def add(self, entry: Resident) -> None:
        self.used[entry.tier] += entry.nbytes
        self.class_used[entry.tier][entry.cls] += entry.nbytes
        self.class_count[entry.tier][entry.cls] += 1

    def remove(self, entry: Resident) -> None:
        self.used[entry.tier] -= entry.nbytes
        self.class_used[entry.tier][entry.cls] -= entry.nbytes
        self.class_count[entry.tier][entry.cls] -= 1

    def blocks(self, tier: str) -> int:
        return sum(self.class_count[tier].values())

    def check(self, heaps: TierHeaps, entries: Iterable[Resident]) -> None:
        """Assert that the accounting matches the resident blocks and that every resident
        block has a live heap item (for tests)."""
        entries = list(entries)
        for tier in TIERS:
            in_tier = [e for e in entries if e.tier == tier]
            used = sum(e.nbytes for e in in_tier)
            assert used == self.used[tier], (tier, used, self.used[tier])
            assert used <= self.budget[tier], (tier, used, self.budget[tier])
            for c in IMPORTANCE_CLASSES:
                of_c = [e for e in in_tier if e.cls == c]
                assert sum(e.nbytes for e in of_c) == self.class_used[tier][c]
                assert len(of_c) == self.class_count[tier][c]
                live = heaps.live_keys(tier, c)
                for e in of_c:
                    assert e.key in live, e.key

    def plan(
        self,
        heaps: TierHeaps,
        where: Mapping[object, Resident],
        tier: str,
        nbytes: int,
        cls: str,
        beat: tuple[float, int] | None,
        now: float,
        protected: Collection[object] = (),
    ) -> list[Resident] | None:
        """Victims that make room for ``nbytes`` of class ``cls`` in ``tier``.

        Returns them in eviction order (lowest key first), ``[]`` when the block fits in
        the free bytes, or ``None`` when admission must be refused. With ``beat``, every
        victim's key must be strictly lower than ``beat``. Heaps are left as they were
        (the caller removes the victims).
        """
        budget = self.budget[tier]
        if budget <= 0 or nbytes > budget:
            return None
        need = self.used[tier] + nbytes - budget
        if need <= 0:
            return []
        quota = {c: self.shares[c] * budget for c in IMPORTANCE_CLASSES}
        planned = dict(self.class_used[tier])
        taken: list[tuple[str, str, HeapItem]] = []
        victims: list[Resident] = []
        freed = 0
        try:
            while freed < need:
                best: HeapItem | None = None
                best_cls = cls
                for c in IMPORTANCE_CLASSES:
                    if c != cls and planned[c] <= quota[c]:
                        continue
                    item = heaps.peek(tier, c, now)
                    while item is not None and item[2] in protected:
                        taken.append((tier, c, heaps.pop(tier, c)))  # set aside, restored below
                        item = heaps.peek(tier, c, now)
                    if item is not None and (best is None or item[:2] < best[:2]):
                        best, best_cls = item, c
                if best is None or (beat is not None and not best[0] < beat):
                    return None
                taken.append((tier, best_cls, heaps.pop(tier, best_cls)))
                victim = where[best[2]]
                victims.append(victim)
                freed += victim.nbytes
                planned[best_cls] -= victim.nbytes
            return victims
        finally:
            heaps.restore(taken)
