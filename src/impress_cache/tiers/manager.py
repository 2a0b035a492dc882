"""Two memory tiers ("device" and "host") caching blocks whose master copy is on disk.

Every stored block lives on disk. The device tier (GPU memory in the real store) and the
host tier (CPU memory) each cache a *disjoint* set of blocks within a byte budget; a
block is in at most one of them. Payloads are opaque to this package: the store passes
``to_device`` / ``to_host`` callables that move them (for example torch tensors between
devices). Nothing here imports torch.

Which block to evict is decided by an `EvictionPolicy` (IMPRESS score, LRU or LFU,
`policies`); `heaps` keeps the resident blocks ordered by the policy's sort key and
`budget` chooses victims within the per-class shares. This module turns those into
admission, promotion and demotion (IMPRESS section 3):

* a device hit refreshes the block's heap position;
* a host hit is promoted to the device when its key beats the device victims it needs;
  the victims are demoted to the host when the host admits them, otherwise dropped
  (disk keeps a copy);
* a block read from disk enters the host when the host has room or the block beats the
  host victims it needs (with ``disk_to_device=True`` it first competes for the device,
  as in the paper, where a disk read "competes with both minimums").

Accesses: `get` and `put_from_disk` do not count as accesses. A request records one
access per block with `touch` (or looks a batch up with `lookup`, which gets each block
under one lock and records its access, applied before anything else reads the tiers'
state: `TouchLog`); ``put_from_disk(..., important_share=x)`` only seeds the statistics
of a block the policy has never seen. A block's class follows its policy
statistics and is re-evaluated when the block is touched.

A request that holds a payload returned by a lookup keeps it valid after the block is
evicted or moved (payloads are never modified in place), so reads need no pins.

Thread safety: all public methods that read or change state hold one re-entrant lock
(entering it applies the recorded accesses); the clock and the transforms are called
under it. `pending_accesses` reads a length without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigError, TierError
from ..validate import check_class_shares, check_int
from .budget import TierSpace
from .counters import TierCounters
from .groups import TierGroups
from .heaps import DEVICE, HOST, Resident, TierHeaps
from .policies.base import EvictionPolicy
from .touchlog import MAX_PENDING, TouchLog
from .view import TierView

logger = logging.getLogger(__name__)

#: Default split of each tier's budget among importance classes (IMPRESS, section 4).
DEFAULT_CLASS_SHARES: dict[str, float] = {"high": 0.3, "medium": 0.5, "low": 0.2}


def _identity(payload: Any) -> Any:
    return payload


class TierManager(TierView, TierGroups):
    """Device and host caches of disk blocks with byte budgets and a policy.

    Parameters
    ----------
    device_bytes, host_bytes:
        Byte budgets of the device and host tiers; ``0`` disables a tier.
    policy:
        Eviction policy; the manager owns its statistics from now on (call `touch`
        rather than ``policy.on_access`` so heap entries follow).
    class_shares:
        Fraction of each tier's budget preallocated to ``"high"``, ``"medium"`` and
        ``"low"`` importance blocks (see `budget`). Default 30/50/20 %.
    clock:
        Monotonic clock in seconds, injected for tests and simulations.
    to_device, to_host:
        Payload transforms applied when a block moves to the device tier (from host or
        disk) and from device to host. Identity by default. Payloads given to
        `put_from_disk` are taken to be in host form.
    disk_to_device:
        When true, a block read from disk first competes for the device tier (paper
        behaviour); when false (default), it only enters the host tier and reaches the
        device through promotion on a later host hit, except when the host budget is
        0, in which case it competes for the device.
    own:
        A payload with storage of its own (for example a tensor's copy), given to the
        members of a dissolved group (`groups`). Identity by default.

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
        own: Callable[[Any], Any] | None = None,
    ) -> None:
        check_int("device_bytes", device_bytes, 0)
        check_int("host_bytes", host_bytes, 0)
        if not isinstance(policy, EvictionPolicy):
            raise ConfigError(
                f"policy must be an EvictionPolicy instance, got {type(policy).__name__}; "
                "use impress_cache.tiers.policies.make_policy(name)"
            )
        shares = check_class_shares(
            "class_shares", DEFAULT_CLASS_SHARES if class_shares is None else class_shares
        )
        self._policy = policy
        self._clock = clock
        self._to_device = to_device if to_device is not None else _identity
        self._to_host = to_host if to_host is not None else _identity
        self._disk_to_device = bool(disk_to_device)
        self._init_groups(own if own is not None else _identity)
        #: the lock; entering it applies the accesses `lookup` recorded (see `TouchLog`)
        self._lock = TouchLog(self._touch)
        self._where: dict[Hashable, Resident] = {}
        self._sizes: dict[Hashable, int] = {}
        self._space = TierSpace({DEVICE: device_bytes, HOST: host_bytes}, shares)
        self._heaps = TierHeaps(policy, self._where)
        #: keys of the batch being served: never victims while it is (see `budget`)
        self._protected: frozenset[Hashable] = frozenset()
        self.reset_stats()

    # ================================================================== properties
    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (shared, not a copy), with every recorded access applied."""
        self.settle()
        return self._policy

    @property
    def class_shares(self) -> dict[str, float]:
        """Budget shares of the importance classes (a copy)."""
        return dict(self._space.shares)

    @property
    def enabled(self) -> bool:
        """Whether either tier has a budget (otherwise every lookup misses)."""
        return any(b > 0 for b in self._space.budget.values())

    # ================================================================== lookups
    def get(self, key: Hashable, nbytes: int | None = None) -> tuple[str, Any] | None:
        """Look a block up in the device tier, then in the host tier.

        Does not count as an access (see `touch`). A host hit is promoted to the device
        when it beats the device victims it needs; the returned tier and payload are
        then the device ones. ``nbytes`` sizes a miss in the byte statistics (default:
        the last size seen for the block). Returns ``(tier, payload)`` or ``None``.
        """
        with self._lock:
            return self._get(key, nbytes, self._now())

    def resident(self, keys: Iterable[Hashable]) -> int:
        """How many of ``keys`` a tier holds (a plain count: no access, no statistics)."""
        where = self._where
        return sum(1 for key in keys if key in where)

    def lookup(
        self, keys: Sequence[Hashable], shares: Sequence[float | None], sizes: Sequence[int]
    ) -> list[tuple[str, Any] | None]:
        """One request's batch: `touch` then `get` every key, under one lock.

        ``shares[i]`` is the important share of ``keys[i]`` for this access and
        ``sizes[i]`` its size (for miss statistics). Keys must be distinct. Returns per
        key ``None`` (a miss) or ``(tier, payload)`` where ``tier`` is the tier the block
        was found in (a host hit that `get` promotes still counts as a host hit).
        """
        # a bad share fails here, as an eager access would, never later as a recorded one
        # that every following call would retry
        shares = [None if s is None else float(s) for s in shares]
        log = self._lock
        with log.raw, self._protecting(keys):
            if log.pending > MAX_PENDING:
                log.drain()
            now = self._now()
            out: list[tuple[str, Any] | None] = []
            later: list[tuple[Hashable, float | None, float]] = []
            try:
                for key, share, size in zip(keys, shares, sizes):
                    entry = self._where.get(key)
                    if entry is not None and entry.tier == HOST:  # may be promoted: state needed now
                        log.record(later)
                        later = []
                        log.drain()
                        self._touch(key, share, now)
                        hit = self._get(key, size, now, sync=False)  # just touched
                        out.append(None if hit is None else (HOST, hit[1]))
                        continue
                    later.append((key, share, now))  # device hit or miss: the access can wait
                    self._get(key, size, now, sync=False)
                    out.append(None if entry is None else (entry.tier, entry.payload))
            finally:
                log.record(later)
            return out

    @property
    def pending_accesses(self) -> int:
        """Accesses `lookup` recorded that are not applied yet."""
        return self._lock.pending

    def settle(self) -> int:
        """Apply the accesses `lookup` recorded (what any other call does first); returns
        how many there were. Requests schedule it off their path."""
        with self._lock.raw:
            n = self._lock.pending
            self._lock.drain()
            return n

    def put_from_disk(
        self, key: Hashable, payload: Any, nbytes: int, important_share: float | None = None
    ) -> str | None:
        """Offer a block just read from disk to the memory tiers.

        The block enters the host tier if the host has enough free bytes or the block
        beats every host victim it needs (victims leave memory; disk keeps them). See
        ``disk_to_device`` for when the device tier is tried first or instead. Does not
        count as an access; ``important_share`` seeds the statistics of a block the
        policy has never seen (``None``: 1.0).

        Returns the tier the block is now in, or ``None`` if no tier admitted it. A
        block already in memory stays where it is (the payload is not replaced).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise TierError(f"nbytes must be an integer >= 0, got {nbytes!r}")
        with self._lock:
            return self._admit(key, payload, nbytes, important_share, self._now())

    def admit(
        self, items: Iterable[tuple[Hashable, Any, int, float | None]], protect: Iterable[Hashable] = ()
    ) -> list[str | None]:
        """`put_from_disk` for a batch of ``(key, payload, nbytes, share)``, under one lock.

        Neither the batch's blocks nor ``protect`` (the rest of the request's blocks) are
        evicted to make room for one of them.
        """
        items = list(items)
        with self._lock, self._protecting([k for k, *_ in items] + list(protect)):
            now = self._now()
            return [self._admit(k, p, n, s, now) for k, p, n, s in items]

    @contextmanager
    def _protecting(self, keys: Iterable[Hashable]) -> Iterator[None]:
        self._protected = frozenset(keys)
        try:
            yield
        finally:
            self._protected = frozenset()

    # ================================================================== statistics
    def touch(self, key: Hashable, important_share: float | None = None) -> None:
        """Record one access of a block by a request (hit or miss).

        ``important_share`` is the fraction of the block's rows the request marked
        important, in ``[0, 1]`` (``None``: 1.0). Updates the policy statistics, the
        block's class and, when it is in memory, its heap position.
        """
        with self._lock:
            self._touch(key, important_share, self._now())

    def refresh(self, key: Hashable) -> None:
        """Re-read a resident block's class and key after its statistics were changed
        directly (for example with ``policy.load_stats``)."""
        with self._lock:
            entry = self._where.get(key)
            if entry is not None:
                self._reposition(entry, self._now())

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
        """Create statistics for a block without counting an access; True if created."""
        with self._lock:
            created = self._policy.seed(key, self._now(), important_share)
            if created and key in self._where:
                self._reposition(self._where[key], self._now())
            return created

    def export_stats(self, keys: Iterable[Hashable] | None = None) -> dict[Hashable, dict[str, Any]]:
        """Statistics of blocks (all known ones by default), rebased to the current
        clock: ``freq`` decayed to now and ``age_s`` since the last access, so the
        records do not depend on the clock's origin. Unknown blocks are skipped."""
        with self._lock:
            now = self._now()
            wanted = self._policy.keys() if keys is None else keys
            return {k: self._policy.stats_of(k, now) for k in wanted if k in self._policy}

    def import_stats(self, records: Mapping[Hashable, Mapping[str, Any]], now: float | None = None) -> int:
        """Install statistics (as from `export_stats`, see ``policy.load_stats`` for
        ``now``) and re-key resident blocks. Returns the number of records."""
        with self._lock:
            for key, rec in records.items():
                self._policy.load_stats(key, rec, now)
                entry = self._where.get(key)
                if entry is not None:
                    self._reposition(entry, self._now())
            return len(records)

    # ================================================================== removal
    def evict(self, key: Hashable) -> bool:
        """Remove a block from memory (disk copy and statistics stay); True if resident."""
        with self._lock:
            entry = self._where.get(key)
            if entry is None:
                return False
            self._remove(entry)
            self._c.removals += 1
            return True

    def drop(self, key: Hashable) -> bool:
        """Forget a block entirely (its disk copy is gone); True if it was resident."""
        return self.drop_many((key,)) > 0

    def drop_many(self, keys: Iterable[Hashable]) -> int:
        """`drop` each of ``keys`` under one hold of the lock (the blocks of deleted chunk
        files: most are neither resident nor known, and cost a dictionary lookup each).
        Returns the number removed from memory."""
        removed = 0
        with self._lock:
            keys = list(keys)
            self._release(keys)
            where, sizes, policy = self._where, self._sizes, self._policy
            for key in keys:
                entry = where.get(key)
                if entry is not None:
                    self._remove(entry)
                    self._c.removals += 1
                    removed += 1
                sizes.pop(key, None)
                if key in policy:
                    policy.forget(key)
        return removed

    def drop_where(self, predicate: Callable[[Hashable], bool]) -> int:
        """`drop` every block whose key satisfies ``predicate`` (for example the blocks of
        a deleted chunk file). Returns the number removed from memory."""
        with self._lock:
            keys = {k for k in self._where if predicate(k)}
            keys.update(k for k in self._policy.keys() if predicate(k))
            return self.drop_many(keys)

    def reset_stats(self) -> None:
        """Zero every counter of `stats` (residency is unchanged)."""
        with self._lock:
            self._c = TierCounters()

    # ================================================================== internals
    def _now(self) -> float:
        return float(self._clock())

    def _touch(self, key: Hashable, share: float | None, now: float) -> None:
        self._policy.on_access(key, now, share)
        entry = self._where.get(key)
        if entry is not None:
            self._reposition(entry, now, lazy=True)

    def _get(self, key: Hashable, nbytes: int | None, now: float, sync: bool = True) -> tuple[str, Any] | None:
        c = self._c
        c.gets += 1
        entry = self._where.get(key)
        if entry is None:
            c.misses += 1
            size = nbytes if nbytes is not None else self._sizes.get(key, 0)
            c.miss_bytes += max(0, int(size))
            return None
        c.hits[entry.tier] += 1
        c.hit_bytes[entry.tier] += entry.nbytes
        if entry.tier == HOST and self._promote(entry, now):
            return (DEVICE, self._where[key].payload)
        if sync:
            self._sync(entry, now)
        return (entry.tier, entry.payload)

    def _admit(self, key: Hashable, payload: Any, nbytes: int, share: float | None, now: float) -> str | None:
        self._sizes[key] = nbytes
        entry = self._where.get(key)
        if entry is not None:
            return entry.tier
        self._policy.seed(key, now, share)
        cls = self._policy.importance_class(key)
        skey = self._policy.sort_key(key, now)
        if self._disk_to_device:
            order: tuple[str, ...] = (DEVICE, HOST)
        elif self._space.budget[HOST] > 0:
            order = (HOST,)
        else:
            order = (DEVICE,)
        for tier in order:
            victims = self._plan(tier, nbytes, cls, skey, now)
            if victims is None:
                continue
            stored = payload
            if tier == DEVICE:
                try:
                    stored = self._to_device(payload)
                except Exception:
                    logger.warning("to_device failed for block %r", key, exc_info=True)
                    continue
            self._evict_victims(tier, victims)
            self._insert(key, tier, stored, nbytes, cls, now)
            self._c.admitted += 1
            self._c.bytes_admitted += nbytes
            if tier == DEVICE:
                self._demote(victims, now)
            return tier
        self._c.refused += 1
        return None

    def _plan(self, tier: str, nbytes: int, cls: str, beat: tuple[float, int] | None, now: float) -> list[Resident] | None:
        if not self._policy.time_invariant_order and self._space.used[tier] + nbytes > self._space.budget[tier]:
            self._heaps.rekey(tier, now)
        return self._space.plan(self._heaps, self._where, tier, nbytes, cls, beat, now, self._protected)

    def _insert(self, key: Hashable, tier: str, payload: Any, nbytes: int, cls: str, now: float) -> None:
        entry = Resident(key=key, tier=tier, payload=payload, nbytes=nbytes, cls=cls)
        self._where[key] = entry
        self._space.add(entry)
        self._heaps.count(entry, +1)
        self._heaps.push(entry, now)

    def _remove(self, entry: Resident) -> None:
        self._ungroup(entry.key)
        del self._where[entry.key]
        self._space.remove(entry)
        self._heaps.count(entry, -1)
        self._heaps.invalidate(entry)

    def _reposition(self, entry: Resident, now: float, lazy: bool = False) -> None:
        """Re-read class and key of a resident block after its statistics changed.

        ``lazy``: when only the key grew (the usual effect of an access), the block keeps
        its heap item: a stale item is lower than the block's key, and `TierHeaps.peek`
        re-keys an item whose key changed before it can become a victim, so the victim
        order stays exact while most accesses skip a heap push.
        """
        cls = self._policy.importance_class(entry.key)
        if cls != entry.cls:
            self._space.remove(entry)
            self._heaps.count(entry, -1)
            entry.cls = cls
            self._space.add(entry)
            self._heaps.count(entry, +1)
        elif lazy and self._policy.time_invariant_order and entry.skey is not None:
            if not self._policy.sort_key(entry.key, now) < entry.skey:
                return
        self._heaps.push(entry, now)

    def _sync(self, entry: Resident, now: float) -> None:
        """Reposition a resident block if the policy changed its class or key."""
        if self._policy.importance_class(entry.key) != entry.cls or (
            self._policy.time_invariant_order and self._policy.sort_key(entry.key, now) != entry.skey
        ):
            self._reposition(entry, now)

    def _evict_victims(self, tier: str, victims: list[Resident]) -> None:
        if tier == HOST or self._space.budget[HOST] <= 0:  # they leave memory: no copies of them
            self._release(v.key for v in victims)
        for victim in victims:
            self._remove(victim)
            self._c.evictions[tier] += 1
            self._c.evicted_bytes[tier] += victim.nbytes

    def _promote(self, entry: Resident, now: float) -> bool:
        """Move a host block to the device if it beats the device victims it needs."""
        if self._space.budget[DEVICE] <= 0:
            return False
        victims = self._plan(DEVICE, entry.nbytes, entry.cls, self._policy.sort_key(entry.key, now), now)
        if victims is None:
            return False
        self._ungroup(entry.key)
        try:
            payload = self._to_device(entry.payload)
        except Exception:
            logger.warning("to_device failed for block %r", entry.key, exc_info=True)
            return False
        self._remove(entry)
        self._evict_victims(DEVICE, victims)
        self._insert(entry.key, DEVICE, payload, entry.nbytes, entry.cls, now)
        self._c.promotions += 1
        self._c.bytes_promoted += entry.nbytes
        self._demote(victims, now)
        return True

    def _demote(self, victims: list[Resident], now: float) -> None:
        """Offer blocks pushed out of the device to the host; the most valuable first."""
        for victim in reversed(victims):
            if self._space.budget[HOST] <= 0:
                return
            plan = self._plan(HOST, victim.nbytes, victim.cls, self._policy.sort_key(victim.key, now), now)
            if plan is None:
                continue
            try:
                payload = self._to_host(victim.payload)
            except Exception:
                logger.warning("to_host failed for block %r", victim.key, exc_info=True)
                continue
            self._evict_victims(HOST, plan)
            self._insert(victim.key, HOST, payload, victim.nbytes, victim.cls, now)
            self._c.demotions += 1
            self._c.bytes_demoted += victim.nbytes

