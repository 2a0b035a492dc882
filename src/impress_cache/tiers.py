"""Two memory tiers ("device" and "host") caching blocks whose master copy is on disk.

Every stored block lives on disk. The device tier (GPU memory in the real store) and the
host tier (CPU memory) each cache a *disjoint* set of blocks within a byte budget; a
block is in at most one of them. Payloads are opaque to this module: the store passes
``to_device`` / ``to_host`` callables that move them (for example torch tensors between
devices). Nothing here imports torch.

Which block to evict is decided by an `EvictionPolicy`
(IMPRESS score, LRU or LFU); this module turns its sort keys into admission, eviction,
promotion and demotion decisions (IMPRESS, section 3):

* a device hit refreshes the block's heap position;
* a host hit is promoted to the device when its key beats the device victims it needs
  (the device minimum when blocks have equal sizes); the victims are demoted to the host
  when the host admits them, otherwise they are dropped (disk keeps a copy);
* a block read from disk enters the host when the host has room or the block beats the
  host victims it needs (with ``disk_to_device=True`` it first competes for the device,
  as in the paper, where a disk read "competes with both minimums").

Accesses
--------
Neither `get` nor `put_from_disk` counts as an
access. The caller records one access per request and block with
`touch` (alias `record_access`), typically right
before ``get``; this keeps frequencies independent of how often a request looks a block
up. ``put_from_disk(..., important_share=x)`` only seeds the statistics of a block the
policy has never seen (zero accesses, share ``x``, recency of now).

Class shares
------------
Each tier's budget is split among the importance classes ``high``, ``medium`` and ``low``
(IMPRESS, section 4: typically 30/50/20 %). The split is soft and protective:

* a block is admitted without eviction whenever the tier has enough free bytes, even if
  its class is over its share (a class borrows space other classes do not use);
* when space must be freed, victims come only from classes that are over their share
  and from the incoming block's own class, lowest sort key first. "Over share" is
  re-evaluated after each victim, so a class stops losing blocks once it is back within
  its share. Hence a burst of low-importance blocks can never evict high-class blocks
  while the high class uses no more than its share;
* pinned blocks are never victims. When the needed bytes cannot be freed this way (or,
  for competitive admission, only by evicting a block with a higher key than the
  incoming one), admission is refused and nothing is evicted. Budgets are never exceeded.

A block's class follows its policy statistics: it is re-evaluated when the block is
touched.

Pins
----
`pin` takes a counted reference on a block in use by a running
request. A pinned block is never evicted or demoted (explicit `evict`
and `drop` refuse unless ``force=True``); it may still be promoted from
host to device, the pin following it. Pinning a block that is not in memory is allowed:
the pin applies once it is admitted.

Thread safety
-------------
All public methods hold one re-entrant lock. Callables passed in (clock, transforms) are
called under that lock.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, ImpressError
from .policies.base import IMPORTANCE_CLASSES, EvictionPolicy

logger = logging.getLogger(__name__)

#: Name of the fast memory tier (GPU memory in the real store).
DEVICE = "device"
#: Name of the slower memory tier (CPU memory in the real store).
HOST = "host"
#: Memory tiers, fastest first.
TIERS: tuple[str, str] = (DEVICE, HOST)

#: Default split of each tier's budget among importance classes (IMPRESS, section 4).
DEFAULT_CLASS_SHARES: dict[str, float] = {"high": 0.3, "medium": 0.5, "low": 0.2}

_COMPACT_MIN = 64

HeapItem = tuple[tuple[float, int], int, Hashable]


class TierError(ImpressError, ValueError):
    """The tier manager was called with an invalid argument or in an invalid state."""


class BlockPinnedError(TierError):
    """A pinned block was asked to leave memory without ``force=True``."""


@dataclass(eq=False)
class _Resident:
    """One block held by a memory tier."""

    key: Hashable
    tier: str
    payload: Any
    nbytes: int
    cls: str
    version: int = 0
    skey: tuple[float, int] | None = None


def _identity(payload: Any) -> Any:
    return payload


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


class TierManager:
    """Device and host caches of disk blocks with byte budgets and a policy.

    Parameters
    ----------
    device_bytes:
        Byte budget of the device tier; ``0`` disables it.
    host_bytes:
        Byte budget of the host tier; ``0`` disables it.
    policy:
        Eviction policy; the manager owns its statistics from now on (call
        `touch` rather than ``policy.on_access`` so heap entries follow).
    class_shares:
        Fraction of each tier's budget preallocated to ``"high"``, ``"medium"`` and
        ``"low"`` importance blocks; non-negative, summing to 1 (see module notes).
        Default ``{"high": 0.3, "medium": 0.5, "low": 0.2}``.
    clock:
        Monotonic clock in seconds, injected for tests.
    to_device, to_host:
        Payload transforms applied when a block moves to the device tier (from host or
        from disk) and from device to host. Identity by default. Payloads given to
        `put_from_disk` are taken to be in host form.
    disk_to_device:
        When true, a block read from disk first competes for the device tier (paper
        behaviour); when false (default), it only enters the host tier and reaches the
        device through promotion on a later host hit, except when the host budget is
        0, in which case it competes for the device.

    Raises
    ------
    ConfigError
        If a budget is negative or not an integer, or the class shares are invalid.
    """

    def __init__(
        self,
        device_bytes: int,
        host_bytes: int,
        policy: EvictionPolicy,
        class_shares: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        to_device: Callable[[Any], Any] | None = None,
        to_host: Callable[[Any], Any] | None = None,
        disk_to_device: bool = False,
    ) -> None:
        for name, value in (("device_bytes", device_bytes), ("host_bytes", host_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(policy, EvictionPolicy):
            raise ConfigError(
                f"policy must be an EvictionPolicy instance, got {type(policy).__name__}; "
                "use impress_cache.policies.make_policy(name)"
            )
        shares = dict(DEFAULT_CLASS_SHARES if class_shares is None else class_shares)
        if set(shares) != set(IMPORTANCE_CLASSES) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0
            for v in shares.values()
        ):
            raise ConfigError(
                "class_shares must map 'high', 'medium' and 'low' to non-negative "
                f"numbers, got {shares!r}"
            )
        if not math.isclose(sum(shares.values()), 1.0, abs_tol=1e-6):
            raise ConfigError(
                f"class_shares must sum to 1, got {sum(shares.values())} for {shares!r}"
            )
        self._policy = policy
        self._shares = {c: float(shares[c]) for c in IMPORTANCE_CLASSES}
        self._clock = clock
        self._to_device = to_device if to_device is not None else _identity
        self._to_host = to_host if to_host is not None else _identity
        self._disk_to_device = bool(disk_to_device)
        self._lock = threading.RLock()

        self._budget = {DEVICE: device_bytes, HOST: host_bytes}
        self._used = {t: 0 for t in TIERS}
        self._class_used = {t: {c: 0 for c in IMPORTANCE_CLASSES} for t in TIERS}
        self._class_count = {t: {c: 0 for c in IMPORTANCE_CLASSES} for t in TIERS}
        self._heaps: dict[str, dict[str, list[HeapItem]]] = {
            t: {c: [] for c in IMPORTANCE_CLASSES} for t in TIERS
        }
        self._where: dict[Hashable, _Resident] = {}
        self._pins: dict[Hashable, int] = {}
        self._sizes: dict[Hashable, int] = {}
        self._version = 0
        self.reset_stats()

    # ================================================================== properties
    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (shared, not a copy)."""
        return self._policy

    @property
    def class_shares(self) -> dict[str, float]:
        """Budget shares of the importance classes (a copy)."""
        return dict(self._shares)

    # ================================================================== lookups
    def get(self, key: Hashable, nbytes: int | None = None) -> tuple[str, Any] | None:
        """Look a block up in the device tier, then in the host tier.

        Does not count as an access (see `touch`). A host hit is promoted to the
        device when it beats the device victims it needs; the returned tier and payload
        are then the device ones.

        Parameters
        ----------
        key:
            Block identifier.
        nbytes:
            Size of the block, used only for byte statistics of a miss. When omitted,
            the last size the manager saw for this block is used (0 if none).

        Returns
        -------
        tuple of (str, object) or None
            ``(tier, payload)`` or ``None`` on a miss (the caller reads the disk copy
            and may call `put_from_disk`).
        """
        with self._lock:
            self._gets += 1
            entry = self._where.get(key)
            if entry is None:
                self._misses += 1
                size = nbytes if nbytes is not None else self._sizes.get(key, 0)
                self._miss_bytes += max(0, int(size))
                return None
            self._hits[entry.tier] += 1
            self._hit_bytes[entry.tier] += entry.nbytes
            now = self._now()
            if entry.tier == DEVICE:
                self._sync(entry, now)
                return (DEVICE, entry.payload)
            if self._promote(entry, now):
                promoted = self._where[key]
                return (DEVICE, promoted.payload)
            self._sync(entry, now)
            return (HOST, entry.payload)

    def put_from_disk(
        self,
        key: Hashable,
        payload: Any,
        nbytes: int,
        important_share: float | None = None,
    ) -> str | None:
        """Offer a block just read from disk to the memory tiers.

        The block enters the host tier if the host has enough free bytes or the block
        beats every host victim it needs (victims leave memory; disk keeps them). See
        ``disk_to_device`` for when the device tier is tried first or instead. Does not
        count as an access.

        Parameters
        ----------
        key:
            Block identifier.
        payload:
            The block's data in host form (opaque).
        nbytes:
            Size charged against the budget.
        important_share:
            Used only when the policy has no statistics for the block: they are then
            created (seeded) with this share (``None``: 1.0) and zero accesses, which
            also stamps the block's recency. Ignored otherwise.

        Returns
        -------
        str or None
            The tier the block is now in, or ``None`` if no tier admitted it. A block
            already in memory stays where it is and its tier is returned (the payload
            is not replaced; `evict` it first to replace it).

        Raises
        ------
        TierError
            If ``nbytes`` is not a non-negative integer.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise TierError(f"nbytes must be an integer >= 0, got {nbytes!r}")
        with self._lock:
            self._sizes[key] = nbytes
            entry = self._where.get(key)
            if entry is not None:
                return entry.tier
            now = self._now()
            self._policy.seed(key, now, important_share)
            cls = self._policy.importance_class(key)
            skey = self._policy.sort_key(key, now)
            if self._disk_to_device:
                order: tuple[str, ...] = (DEVICE, HOST)
            elif self._budget[HOST] > 0:
                order = (HOST,)
            else:
                order = (DEVICE,)
            for tier in order:
                victims = self._plan(tier, nbytes, cls, skey, now)
                if victims is None:
                    continue
                if tier == DEVICE:
                    try:
                        stored = self._to_device(payload)
                    except Exception:
                        logger.warning("to_device failed for block %r", key, exc_info=True)
                        continue
                else:
                    stored = payload
                self._evict_victims(tier, victims)
                self._insert(key, tier, stored, nbytes, cls, now)
                self._admitted += 1
                self._bytes_admitted += nbytes
                if tier == DEVICE:
                    self._demote(victims, now)
                logger.debug("block %r admitted from disk into %s", key, tier)
                return tier
            self._refused += 1
            return None

    # ================================================================== statistics
    def touch(self, key: Hashable, important_share: float | None = None) -> None:
        """Record one access of a block by a request (hit or miss).

        Call once per request and block. Updates the policy statistics, the block's
        importance class and, when the block is in memory, its heap position.

        Parameters
        ----------
        key:
            Block identifier.
        important_share:
            Fraction of the block's rows the request marked important, in ``[0, 1]``;
            ``None`` counts as 1.0.
        """
        with self._lock:
            now = self._now()
            self._policy.on_access(key, now, important_share)
            entry = self._where.get(key)
            if entry is not None:
                self._reposition(entry, now)

    def record_access(self, key: Hashable, important_share: float | None = None) -> None:
        """Alias of `touch`."""
        self.touch(key, important_share)

    def refresh(self, key: Hashable) -> None:
        """Re-read a resident block's class and key from the policy.

        Needed only after changing the policy's statistics directly (for example
        ``policy.load_stats``) while the block is in memory.
        """
        with self._lock:
            entry = self._where.get(key)
            if entry is not None:
                self._reposition(entry, self._now())

    # ================================================================== statistics access
    def now(self) -> float:
        """Current reading of the manager's clock, in seconds."""
        return self._now()

    def priority(self, key: Hashable) -> float:
        """The policy's eviction priority of a block now (lower goes first)."""
        with self._lock:
            return float(self._policy.priority(key, self._now()))

    def importance_share(self, key: Hashable) -> float:
        """The policy's moving average of the block's important share (1.0 if unknown)."""
        with self._lock:
            return float(self._policy.importance_share(key))

    def has_stats(self, key: Hashable) -> bool:
        """Whether the policy holds statistics for the block."""
        with self._lock:
            return key in self._policy

    def seed(self, key: Hashable, important_share: float | None = None) -> bool:
        """Create statistics for a block without counting an access (see ``policy.seed``).

        Returns
        -------
        bool
            True when statistics were created (False if the block already had some).
        """
        with self._lock:
            created = self._policy.seed(key, self._now(), important_share)
            if created and key in self._where:
                self._reposition(self._where[key], self._now())
            return created

    def export_stats(
        self, keys: Iterable[Hashable] | None = None
    ) -> dict[Hashable, dict[str, Any]]:
        """Statistics of blocks, rebased to the current clock (see ``policy.stats_of``).

        Parameters
        ----------
        keys:
            Blocks to export; ``None`` exports every block the policy knows. Blocks
            without statistics are skipped.

        Returns
        -------
        dict
            ``key -> record`` with ``freq`` decayed to now and ``age_s`` (seconds since
            the last access), so the records do not depend on the clock's origin.
        """
        with self._lock:
            now = self._now()
            wanted = self._policy.keys() if keys is None else keys
            return {k: self._policy.stats_of(k, now) for k in wanted if k in self._policy}

    def import_stats(
        self, records: Mapping[Hashable, Mapping[str, Any]], now: float | None = None
    ) -> int:
        """Install statistics (as from `export_stats`) and re-key resident blocks.

        Parameters
        ----------
        records:
            ``key -> record``; see ``policy.load_stats``.
        now:
            Passed to ``policy.load_stats``: with a clock value, ``freq`` is taken as of
            that time and ``last_access = now - age_s``; with ``None`` the records'
            ``freq_time`` and ``last_access`` are used as given (already in this
            manager's clock).

        Returns
        -------
        int
            Number of records installed.
        """
        with self._lock:
            for key, rec in records.items():
                self._policy.load_stats(key, rec, now)
                entry = self._where.get(key)
                if entry is not None:
                    self._reposition(entry, self._now())
            return len(records)

    def drop_where(self, predicate: Callable[[Hashable], bool]) -> int:
        """Forget every block whose key satisfies ``predicate``: memory, pins, statistics.

        For blocks whose disk copy is gone (for example a deleted chunk file).

        Returns
        -------
        int
            Number of blocks removed from memory.
        """
        with self._lock:
            keys = {k for k in self._where if predicate(k)}
            keys.update(k for k in self._policy.keys() if predicate(k))
            keys.update(k for k in self._pins if predicate(k))
            return sum(self.drop(k, force=True) for k in keys)

    # ================================================================== pins
    def pin(self, key: Hashable) -> int:
        """Take a reference on a block; pinned blocks never leave memory.

        Returns
        -------
        int
            The new reference count.
        """
        with self._lock:
            count = self._pins.get(key, 0) + 1
            self._pins[key] = count
            entry = self._where.get(key)
            if count == 1 and entry is not None:
                self._invalidate(entry)
            return count

    def unpin(self, key: Hashable) -> int:
        """Release a reference taken by `pin`.

        Returns
        -------
        int
            The remaining reference count.

        Raises
        ------
        TierError
            If the block is not pinned.
        """
        with self._lock:
            count = self._pins.get(key, 0)
            if count <= 0:
                raise TierError(f"block {key!r} is not pinned; every unpin needs a pin")
            count -= 1
            if count:
                self._pins[key] = count
            else:
                del self._pins[key]
                entry = self._where.get(key)
                if entry is not None:
                    self._push(entry, self._now())
            return count

    def pin_count(self, key: Hashable) -> int:
        """Number of references held on a block."""
        with self._lock:
            return self._pins.get(key, 0)

    # ================================================================== removal
    def evict(self, key: Hashable, force: bool = False) -> bool:
        """Remove a block from memory; its disk copy and statistics stay.

        Parameters
        ----------
        key:
            Block identifier.
        force:
            Remove it even if pinned (the pin count is kept and applies again if the
            block is re-admitted).

        Returns
        -------
        bool
            Whether the block was in memory.

        Raises
        ------
        BlockPinnedError
            If the block is pinned and ``force`` is false.
        """
        with self._lock:
            self._check_unpinned(key, force, "evict")
            entry = self._where.get(key)
            if entry is None:
                return False
            self._remove(entry)
            self._removals += 1
            return True

    def drop(self, key: Hashable, force: bool = False) -> bool:
        """Forget a block entirely (its disk copy is gone): memory, pins, statistics.

        Parameters
        ----------
        key:
            Block identifier.
        force:
            Drop it even if pinned (the pins are discarded).

        Returns
        -------
        bool
            Whether the block was in memory.

        Raises
        ------
        BlockPinnedError
            If the block is pinned and ``force`` is false.
        """
        with self._lock:
            self._check_unpinned(key, force, "drop")
            entry = self._where.get(key)
            if entry is not None:
                self._remove(entry)
                self._removals += 1
            self._pins.pop(key, None)
            self._sizes.pop(key, None)
            self._policy.forget(key)
            return entry is not None

    # ================================================================== introspection
    def tier_of(self, key: Hashable) -> str | None:
        """``"device"``, ``"host"`` or ``None`` (only on disk)."""
        with self._lock:
            entry = self._where.get(key)
            return None if entry is None else entry.tier

    def used_bytes(self, tier: str) -> int:
        """Bytes of the blocks resident in ``tier``."""
        with self._lock:
            return self._used[self._check_tier(tier)]

    def budget(self, tier: str) -> int:
        """Byte budget of ``tier``."""
        with self._lock:
            return self._budget[self._check_tier(tier)]

    def class_bytes(self, tier: str) -> dict[str, int]:
        """Bytes of the blocks resident in ``tier`` per importance class."""
        with self._lock:
            return dict(self._class_used[self._check_tier(tier)])

    def blocks(self, tier: str | None = None) -> list[Hashable]:
        """Keys of the blocks resident in ``tier`` (both tiers when ``None``)."""
        with self._lock:
            if tier is not None:
                self._check_tier(tier)
            return [k for k, e in self._where.items() if tier is None or e.tier == tier]

    def nbytes_of(self, key: Hashable) -> int | None:
        """Size of a resident block, or ``None`` when it is not in memory."""
        with self._lock:
            entry = self._where.get(key)
            return None if entry is None else entry.nbytes

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._where

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def __repr__(self) -> str:
        with self._lock:
            parts = ", ".join(
                f"{t}={self._used[t]}/{self._budget[t]}B" for t in TIERS
            )
            return f"TierManager({parts}, policy={self._policy.name})"

    def stats(self) -> dict[str, Any]:
        """Counters since construction or the last `reset_stats`.

        Returns
        -------
        dict
            ``gets``; per tier (``"device"``, ``"host"``): ``hits`` (gets served by the
            tier), ``misses`` (gets not served by it), ``hit_ratio``, ``hit_bytes``,
            ``miss_bytes``, ``byte_hit_ratio``, ``evictions`` and ``evicted_bytes``
            (blocks pushed out for space; for the device this includes demotions),
            ``used_bytes``, ``budget``, ``blocks``, ``class_bytes``; ``"memory"``: the
            same hit/miss figures for both tiers together (a miss is a disk read); and
            ``promotions``, ``bytes_promoted`` (host to device), ``demotions``,
            ``bytes_demoted`` (device to host), ``admissions_from_disk``,
            ``bytes_admitted_from_disk``, ``admissions_refused``, ``removals``
            (explicit evict/drop), ``pinned_blocks``.
        """
        with self._lock:
            gets = self._gets
            total_hit_bytes = sum(self._hit_bytes.values())
            all_bytes = total_hit_bytes + self._miss_bytes
            out: dict[str, Any] = {"gets": gets}
            for tier in TIERS:
                hits = self._hits[tier]
                hit_bytes = self._hit_bytes[tier]
                out[tier] = {
                    "hits": hits,
                    "misses": gets - hits,
                    "hit_ratio": _ratio(hits, gets),
                    "hit_bytes": hit_bytes,
                    "miss_bytes": all_bytes - hit_bytes,
                    "byte_hit_ratio": _ratio(hit_bytes, all_bytes),
                    "evictions": self._evictions[tier],
                    "evicted_bytes": self._evicted_bytes[tier],
                    "used_bytes": self._used[tier],
                    "budget": self._budget[tier],
                    "blocks": sum(self._class_count[tier].values()),
                    "class_bytes": dict(self._class_used[tier]),
                }
            mem_hits = sum(self._hits.values())
            out["memory"] = {
                "hits": mem_hits,
                "misses": self._misses,
                "hit_ratio": _ratio(mem_hits, gets),
                "hit_bytes": total_hit_bytes,
                "miss_bytes": self._miss_bytes,
                "byte_hit_ratio": _ratio(total_hit_bytes, all_bytes),
            }
            out.update(
                promotions=self._promotions,
                bytes_promoted=self._bytes_promoted,
                demotions=self._demotions,
                bytes_demoted=self._bytes_demoted,
                admissions_from_disk=self._admitted,
                bytes_admitted_from_disk=self._bytes_admitted,
                admissions_refused=self._refused,
                removals=self._removals,
                pinned_blocks=len(self._pins),
            )
            return out

    def reset_stats(self) -> None:
        """Zero every counter of `stats` (residency is unchanged)."""
        with self._lock:
            self._gets = 0
            self._misses = 0
            self._miss_bytes = 0
            self._hits = {t: 0 for t in TIERS}
            self._hit_bytes = {t: 0 for t in TIERS}
            self._evictions = {t: 0 for t in TIERS}
            self._evicted_bytes = {t: 0 for t in TIERS}
            self._promotions = 0
            self._bytes_promoted = 0
            self._demotions = 0
            self._bytes_demoted = 0
            self._admitted = 0
            self._bytes_admitted = 0
            self._refused = 0
            self._removals = 0

    # ================================================================== internals
    def _now(self) -> float:
        return float(self._clock())

    @staticmethod
    def _check_tier(tier: str) -> str:
        if tier not in TIERS:
            raise TierError(f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")
        return tier

    def _check_unpinned(self, key: Hashable, force: bool, action: str) -> None:
        count = self._pins.get(key, 0)
        if count and not force:
            raise BlockPinnedError(
                f"cannot {action} block {key!r}: it is pinned by {count} reference(s); "
                "unpin it first or pass force=True"
            )

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    def _invalidate(self, entry: _Resident) -> None:
        """Make every heap item of ``entry`` stale."""
        entry.version = self._next_version()

    def _push(self, entry: _Resident, now: float) -> None:
        """Give an unpinned resident block a fresh heap item."""
        entry.version = self._next_version()
        entry.skey = self._policy.sort_key(entry.key, now)
        heap = self._heaps[entry.tier][entry.cls]
        heapq.heappush(heap, (entry.skey, entry.version, entry.key))
        live = self._class_count[entry.tier][entry.cls]
        if len(heap) > _COMPACT_MIN and len(heap) > 4 * live:
            self._compact(entry.tier, entry.cls)

    def _compact(self, tier: str, cls: str) -> None:
        """Drop stale items from one heap."""
        heap = self._heaps[tier][cls]
        kept = []
        for item in heap:
            entry = self._where.get(item[2])
            if (
                entry is not None
                and entry.tier == tier
                and entry.cls == cls
                and entry.version == item[1]
            ):
                kept.append(item)
        heapq.heapify(kept)
        self._heaps[tier][cls] = kept

    def _rekey_tier(self, tier: str, now: float) -> None:
        """Recompute every key of a tier (policies whose order depends on time)."""
        for cls in IMPORTANCE_CLASSES:
            self._heaps[tier][cls] = []
        for entry in self._where.values():
            if entry.tier == tier:
                if self._pins.get(entry.key, 0):
                    self._invalidate(entry)
                else:
                    self._push(entry, now)

    def _insert(
        self, key: Hashable, tier: str, payload: Any, nbytes: int, cls: str, now: float
    ) -> _Resident:
        entry = _Resident(key=key, tier=tier, payload=payload, nbytes=nbytes, cls=cls)
        self._where[key] = entry
        self._used[tier] += nbytes
        self._class_used[tier][cls] += nbytes
        self._class_count[tier][cls] += 1
        if self._pins.get(key, 0):
            self._invalidate(entry)
        else:
            self._push(entry, now)
        return entry

    def _remove(self, entry: _Resident) -> None:
        del self._where[entry.key]
        self._used[entry.tier] -= entry.nbytes
        self._class_used[entry.tier][entry.cls] -= entry.nbytes
        self._class_count[entry.tier][entry.cls] -= 1
        self._invalidate(entry)

    def _reposition(self, entry: _Resident, now: float) -> None:
        """Re-read class and key of a resident block after its statistics changed."""
        cls = self._policy.importance_class(entry.key)
        if cls != entry.cls:
            tier = entry.tier
            self._class_used[tier][entry.cls] -= entry.nbytes
            self._class_count[tier][entry.cls] -= 1
            self._class_used[tier][cls] += entry.nbytes
            self._class_count[tier][cls] += 1
            entry.cls = cls
        if self._pins.get(entry.key, 0):
            self._invalidate(entry)
        else:
            self._push(entry, now)

    def _sync(self, entry: _Resident, now: float) -> None:
        """Reposition a resident block if the policy changed its class or key."""
        if self._pins.get(entry.key, 0):
            return
        if (
            self._policy.importance_class(entry.key) != entry.cls
            or (
                self._policy.time_invariant_order
                and self._policy.sort_key(entry.key, now) != entry.skey
            )
        ):
            self._reposition(entry, now)

    def _peek(self, tier: str, cls: str, now: float) -> HeapItem | None:
        """Smallest valid item of a heap, discarding stale ones and re-keying changed ones."""
        heap = self._heaps[tier][cls]
        while heap:
            skey, version, key = heap[0]
            entry = self._where.get(key)
            if (
                entry is None
                or entry.tier != tier
                or entry.cls != cls
                or entry.version != version
                or self._pins.get(key, 0)
            ):
                heapq.heappop(heap)
                continue
            current = self._policy.sort_key(key, now)
            if current != skey:
                # Statistics changed behind the manager's back: lazy re-key.
                heapq.heappop(heap)
                self._push(entry, now)
                heap = self._heaps[tier][cls]
                continue
            return heap[0]
        return None

    def _plan(
        self,
        tier: str,
        nbytes: int,
        cls: str,
        beat: tuple[float, int] | None,
        now: float,
    ) -> list[_Resident] | None:
        """Choose the victims that make room for ``nbytes`` of class ``cls`` in ``tier``.

        Returns the victims in eviction order (lowest key first), ``[]`` when the block
        fits in the free bytes, or ``None`` when admission must be refused. With
        ``beat``, every victim's key must be strictly lower than ``beat``. Heaps are
        left as they were (the caller removes the victims).
        """
        budget = self._budget[tier]
        if budget <= 0 or nbytes > budget:
            return None
        need = self._used[tier] + nbytes - budget
        if need <= 0:
            return []
        if not self._policy.time_invariant_order:
            self._rekey_tier(tier, now)
        quota = {c: self._shares[c] * budget for c in IMPORTANCE_CLASSES}
        planned = dict(self._class_used[tier])
        taken: list[tuple[str, HeapItem]] = []
        victims: list[_Resident] = []
        freed = 0
        try:
            while freed < need:
                best: HeapItem | None = None
                best_cls = cls
                for c in IMPORTANCE_CLASSES:
                    if c != cls and planned[c] <= quota[c]:
                        continue
                    item = self._peek(tier, c, now)
                    if item is not None and (best is None or item[:2] < best[:2]):
                        best, best_cls = item, c
                if best is None:
                    return None
                if beat is not None and not best[0] < beat:
                    return None
                heapq.heappop(self._heaps[tier][best_cls])
                taken.append((best_cls, best))
                victim = self._where[best[2]]
                victims.append(victim)
                freed += victim.nbytes
                planned[best_cls] -= victim.nbytes
            return victims
        finally:
            for c, item in taken:
                heapq.heappush(self._heaps[tier][c], item)

    def _evict_victims(self, tier: str, victims: list[_Resident]) -> None:
        for victim in victims:
            self._remove(victim)
            self._evictions[tier] += 1
            self._evicted_bytes[tier] += victim.nbytes
            logger.debug("block %r evicted from %s", victim.key, tier)

    def _promote(self, entry: _Resident, now: float) -> bool:
        """Move a host block to the device if it beats the device victims it needs."""
        if self._budget[DEVICE] <= 0:
            return False
        skey = self._policy.sort_key(entry.key, now)
        victims = self._plan(DEVICE, entry.nbytes, entry.cls, skey, now)
        if victims is None:
            return False
        try:
            payload = self._to_device(entry.payload)
        except Exception:
            logger.warning("to_device failed for block %r", entry.key, exc_info=True)
            return False
        self._remove(entry)
        self._evict_victims(DEVICE, victims)
        self._insert(entry.key, DEVICE, payload, entry.nbytes, entry.cls, now)
        self._promotions += 1
        self._bytes_promoted += entry.nbytes
        logger.debug("block %r promoted to device", entry.key)
        self._demote(victims, now)
        return True

    def _demote(self, victims: list[_Resident], now: float) -> None:
        """Offer blocks pushed out of the device to the host; the most valuable first."""
        for victim in reversed(victims):
            if self._budget[HOST] <= 0:
                return
            plan = self._plan(
                HOST, victim.nbytes, victim.cls, self._policy.sort_key(victim.key, now), now
            )
            if plan is None:
                logger.debug("block %r dropped from device to disk only", victim.key)
                continue
            try:
                payload = self._to_host(victim.payload)
            except Exception:
                logger.warning("to_host failed for block %r", victim.key, exc_info=True)
                continue
            self._evict_victims(HOST, plan)
            self._insert(victim.key, HOST, payload, victim.nbytes, victim.cls, now)
            self._demotions += 1
            self._bytes_demoted += victim.nbytes

    def _check_invariants(self) -> None:
        """Assert internal consistency (for tests); raises AssertionError."""
        with self._lock:
            for tier in TIERS:
                entries = [e for e in self._where.values() if e.tier == tier]
                used = sum(e.nbytes for e in entries)
                assert used == self._used[tier], (tier, used, self._used[tier])
                assert used <= self._budget[tier], (tier, used, self._budget[tier])
                for c in IMPORTANCE_CLASSES:
                    of_c = [e for e in entries if e.cls == c]
                    assert sum(e.nbytes for e in of_c) == self._class_used[tier][c]
                    assert len(of_c) == self._class_count[tier][c]
                    live = {
                        item[2]
                        for item in self._heaps[tier][c]
                        if item[2] in self._where and self._where[item[2]].version == item[1]
                    }
                    for e in of_c:
                        if self._pins.get(e.key, 0):
                            assert e.key not in live, e.key
                        else:
                            assert e.key in live, e.key
            for key, count in self._pins.items():
                assert count > 0, (key, count)
