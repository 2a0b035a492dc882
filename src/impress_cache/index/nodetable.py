"""The radix tree's nodes by id (`NodeTable`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from .files import find_sorted

if TYPE_CHECKING:
    from .radix import RadixNode


class NodeTable:
    """Nodes by id: those the tree was loaded with as columns (their ids, sorted; the
    nodes, in the order they were built, a removed one leaving ``None``; ``rows``: where
    the node of each id is, ``None`` when the nodes are in id order), those added since
    in a dict. No int object and dict entry per loaded node."""

    __slots__ = ("_ids", "_objs", "_rows", "_loaded", "_more")

    def __init__(
        self, more: dict[int, RadixNode], ids: np.ndarray | None = None, objs: list | None = None,
        rows: np.ndarray | None = None,
    ) -> None:
        self._ids = np.zeros(0, np.int64) if ids is None else ids
        self._objs: list[RadixNode | None] = [] if objs is None else objs
        self._rows = rows
        self._loaded = len(self._objs)
        self._more = more

    def _at(self, node_id: int) -> int:
        """The place in ``_objs`` of a loaded id, or -1."""
        i = find_sorted(self._ids, node_id)
        return i if i < 0 or self._rows is None else int(self._rows[i])

    def get(self, node_id: int) -> RadixNode | None:
        node = self._more.get(node_id)
        if node is None and len(self._ids):
            i = self._at(node_id)
            return self._objs[i] if i >= 0 else None
        return node

    def __contains__(self, node_id: int) -> bool:
        return self.get(node_id) is not None

    def __getitem__(self, node_id: int) -> RadixNode:
        node = self.get(node_id)
        if node is None:
            raise KeyError(node_id)
        return node

    def __setitem__(self, node_id: int, node: RadixNode) -> None:
        self._more[node_id] = node  # (a new id: ids are never used twice)

    def __delitem__(self, node_id: int) -> None:
        if self._more.pop(node_id, None) is None:
            i = self._at(node_id)
            if i < 0 or self._objs[i] is None:
                raise KeyError(node_id)
            self._objs[i] = None
            self._loaded -= 1

    def __len__(self) -> int:
        return self._loaded + len(self._more)

    def values(self) -> Iterator[RadixNode]:
        yield from (n for n in self._objs if n is not None)
        yield from list(self._more.values())

    def max_id(self) -> int:
        rows, objs = self._rows, self._objs
        last = next(  # the largest loaded id still in the table
            (int(self._ids[i]) for i in range(len(self._ids) - 1, -1, -1) if objs[i if rows is None else int(rows[i])] is not None),
            None,
        )
        return max([*([last] if last is not None else []), *self._more])
