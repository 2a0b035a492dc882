"""Groups of resident blocks that share one payload storage, served as a whole.

A caller that admits several blocks whose payloads are views of one object (the store:
the blocks of one chunk file's layer, views of one contiguous tensor) can *bind* them
as a group with an opaque ``data`` (that object). While every member stays resident,
untouched by moves, `TierGroups.group_hit` serves the members' run ``[lo, hi)`` in one
call: their accesses are recorded as one entry of the `TouchLog` (applied later, one by
one, exactly as `TierManager.lookup` records device hits) and the hit counters move by
the run's blocks and bytes, with no per-block work on the caller's path.

A group never outlives any change to a member: the first member removed, promoted or
demoted dissolves it, and every member's payload is replaced by one with storage of its
own (the manager's ``own`` transform), so that the shared object is freed once the
requests that hold it are done and the tiers' byte accounting keeps meaning what it
says. A dissolved group's ``data`` is forgotten: a group hit after any member changed is
a miss, never a stale payload.

Nothing here imports torch: payloads and ``data`` stay opaque.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .heaps import DEVICE, HOST, Resident
from .touchlog import MAX_PENDING


@dataclass(eq=False)
class Group:
    """Members (in order), the tier they were bound in, their sizes and the shared data."""

    members: tuple[Hashable, ...]
    tier: str
    sizes: tuple[int, ...]
    data: Any


class TierGroups:
    """Group binding and group hits of a `TierManager` (which owns the state it uses)."""

    _lock: Any
    _where: dict[Hashable, Resident]
    _space: Any
    _c: Any
    _own: Callable[[Any], Any]
    _groups: dict[Hashable, Group]
    _group_of: dict[Hashable, Hashable]

    def _now(self) -> float:  # the manager's clock
        raise NotImplementedError

    def _init_groups(self, own: Callable[[Any], Any]) -> None:
        self._own = own
        #: bound groups, and each member's group
        self._groups = {}
        self._group_of = {}

    def bind_group(self, group: Hashable, keys: Sequence[Hashable], payloads: Sequence[Any], data: Any) -> bool:
        """Make ``keys`` a group served through ``data``, if each key is resident with
        exactly the payload given (``payloads[i]`` is ``keys[i]``'s, compared by
        identity) and all are in one tier. Otherwise the keys resident with the given
        payload get payloads of their own (nothing keeps ``data`` alive) and False is
        returned. A group already bound under ``group`` is dissolved first."""
        with self._lock:
            if group in self._groups:
                self._dissolve(group)
            entries = [self._where.get(k) for k in keys]
            tiers = {e.tier for e in entries if e is not None}
            ok = bool(keys) and len(tiers) == 1 and all(
                e is not None and e.payload is p and e.key not in self._group_of for e, p in zip(entries, payloads)
            )
            if not ok:
                for e, p in zip(entries, payloads):
                    if e is not None and e.payload is p:
                        e.payload = self._own(p)
                return False
            self._groups[group] = Group(tuple(keys), tiers.pop(), tuple(e.nbytes for e in entries), data)  # type: ignore[union-attr]
            for k in keys:
                self._group_of[k] = group
            return True

    def regroup(
        self, group: Hashable, keys: Sequence[Hashable], make: Callable[[list[Any]], tuple[list[Any], Any]]
    ) -> bool:
        """Bind resident blocks that are in no group, all in one tier, as ``group``:
        ``make(payloads)`` (called under the lock) gives their new payloads, with the
        same contents and sizes, views of the returned data. False (nothing changed)
        when some key is not resident, is in a group or the tiers differ."""
        with self._lock:
            entries = [self._where.get(k) for k in keys]
            if not keys or any(e is None or e.key in self._group_of for e in entries):
                return False
            tiers = {e.tier for e in entries}  # type: ignore[union-attr]
            if len(tiers) != 1 or group in self._groups:
                return False
            payloads, data = make([e.payload for e in entries])  # type: ignore[union-attr]
            for e, p in zip(entries, payloads):
                e.payload = p  # type: ignore[union-attr]
            self._groups[group] = Group(tuple(keys), tiers.pop(), tuple(e.nbytes for e in entries), data)  # type: ignore[union-attr]
            for k in keys:
                self._group_of[k] = group
            return True

    def group_hit(
        self, group: Hashable, lo: int, hi: int, share: float | None = None
    ) -> tuple[Any, str, tuple[Hashable, ...]] | None:
        """Members ``lo .. hi - 1`` of an intact group: ``(data, tier, their keys)``, each
        counted as a hit and recorded as one access with ``share`` (applied later, as a
        `lookup`'s device hits are). ``None`` when the group is gone (a member changed) or
        sits in the host tier while the device tier has a budget: a host hit may be
        promoted, which `lookup` decides per block."""
        share = None if share is None else float(share)
        log = self._lock
        with log.raw:
            if log.pending > MAX_PENDING:
                log.drain()
            g = self._groups.get(group)
            if g is None or not 0 <= lo < hi <= len(g.members):
                return None
            if g.tier == HOST and self._space.budget[DEVICE] > 0:
                return None
            keys = g.members[lo:hi]
            c = self._c
            n = hi - lo
            c.gets += n
            c.hits[g.tier] += n
            c.hit_bytes[g.tier] += sum(g.sizes[lo:hi])
            log.record_bulk(keys, share, self._now())
            return g.data, g.tier, keys

    def group_intact(self, group: Hashable) -> bool:
        """Whether ``group`` is bound and none of its members changed since."""
        with self._lock.raw:
            return group in self._groups

    @property
    def group_count(self) -> int:
        """Groups bound now (intact)."""
        return len(self._groups)

    def _ungroup(self, key: Hashable) -> None:
        """Dissolve the group of ``key`` (if any) before the block changes."""
        group = self._group_of.get(key)
        if group is not None:
            self._dissolve(group)

    def _release(self, keys: Iterable[Hashable]) -> None:
        """Dissolve the groups of blocks about to leave memory for good: only their
        members that stay get payloads of their own (no copy of a block being dropped)."""
        if not self._group_of:
            return
        leaving = set(keys)
        for group in {self._group_of[k] for k in leaving if k in self._group_of}:
            self._dissolve(group, leaving)

    def _dissolve(self, group: Hashable, leaving: Container[Hashable] = ()) -> None:
        g = self._groups.pop(group)
        for k in g.members:
            del self._group_of[k]
            e = self._where.get(k)
            if e is not None and k not in leaving:
                e.payload = self._own(e.payload)
