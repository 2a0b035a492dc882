"""Hit, miss and movement counters of the memory tiers, and the `TierManager.stats` report."""

from __future__ import annotations

from typing import Any

from .budget import TierSpace
from .heaps import TIERS


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


class TierCounters:
    """Counters since construction or the last reset (the manager's lock protects them)."""

    def __init__(self) -> None:
        self.gets = self.misses = self.miss_bytes = 0
        self.promotions = self.bytes_promoted = self.demotions = self.bytes_demoted = 0
        self.admitted = self.bytes_admitted = self.refused = self.removals = 0
        self.hits = {t: 0 for t in TIERS}
        self.hit_bytes = {t: 0 for t in TIERS}
        self.evictions = {t: 0 for t in TIERS}
        self.evicted_bytes = {t: 0 for t in TIERS}

    def report(self, space: TierSpace) -> dict[str, Any]:
        """``gets``; per tier (``"device"``, ``"host"``): ``hits``, ``misses`` (gets not
        served by the tier), ``hit_ratio``, ``hit_bytes``, ``miss_bytes``,
        ``byte_hit_ratio``, ``evictions`` and ``evicted_bytes`` (blocks pushed out for
        space; for the device this includes demotions), ``used_bytes``, ``budget``,
        ``blocks``, ``class_bytes``; ``"memory"``: the same hit/miss figures for both tiers
        together (a miss is a disk read); ``promotions``, ``bytes_promoted`` (host to
        device), ``demotions``, ``bytes_demoted`` (device to host),
        ``admissions_from_disk``, ``bytes_admitted_from_disk``, ``admissions_refused`` and
        ``removals`` (explicit evict/drop)."""
        gets = self.gets
        hit_bytes_all = sum(self.hit_bytes.values())
        all_bytes = hit_bytes_all + self.miss_bytes
        out: dict[str, Any] = {"gets": gets}
        for tier in TIERS:
            hits, hit_bytes = self.hits[tier], self.hit_bytes[tier]
            out[tier] = {
                "hits": hits,
                "misses": gets - hits,
                "hit_ratio": _ratio(hits, gets),
                "hit_bytes": hit_bytes,
                "miss_bytes": all_bytes - hit_bytes,
                "byte_hit_ratio": _ratio(hit_bytes, all_bytes),
                "evictions": self.evictions[tier],
                "evicted_bytes": self.evicted_bytes[tier],
                "used_bytes": space.used[tier],
                "budget": space.budget[tier],
                "blocks": space.blocks(tier),
                "class_bytes": dict(space.class_used[tier]),
            }
        mem_hits = sum(self.hits.values())
        out["memory"] = {
            "hits": mem_hits,
            "misses": self.misses,
            "hit_ratio": _ratio(mem_hits, gets),
            "hit_bytes": hit_bytes_all,
            "miss_bytes": self.miss_bytes,
            "byte_hit_ratio": _ratio(hit_bytes_all, all_bytes),
        }
        out.update(
            promotions=self.promotions,
            bytes_promoted=self.bytes_promoted,
            demotions=self.demotions,
            bytes_demoted=self.bytes_demoted,
            admissions_from_disk=self.admitted,
            bytes_admitted_from_disk=self.bytes_admitted,
            admissions_refused=self.refused,
            removals=self.removals,
        )
        return out
