"""Radix tree over token ids: which stored prefix matches a prompt, and where its rows live.

No torch. Every node is an edge label (a run of token ids) plus the location of those
tokens' K/V rows: rows ``file_row .. file_row + length`` of chunk file ``file_id``. A
node's tokens are a run of the token array of its file (each token once in memory: in
one shared buffer of two or four bytes per token for a tree loaded from the index). The
tree holds every prefix of every inserted sequence, so a prompt that diverges in the
middle of a stored one still matches their common part.

Nodes are immutable once in the tree: a split replaces a node by two new nodes (the
upper one keeps the first rows of the same file, the lower one the rest, with the old
node's children), so a request that matched the old node keeps reading exactly the rows
it matched. Updates are planned first (`plan_insert`) and applied only once the index
has committed them (`apply`), with the ids the index gave the new nodes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from .nodetable import NodeTable

TokenArray = np.ndarray


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D ``int32`` array (no copy when they already are one)."""
    arr = np.asarray(tokens)
    if arr.dtype != np.int32:
        arr = arr.astype(np.int32)
    return arr if arr.ndim == 1 else arr.reshape(-1)


#: the children of a leaf (read-only: the tree gives a node a dict of its own when it
#: gets its first child)
_NO_CHILDREN: Mapping[int, RadixNode] = MappingProxyType({})


class _Packed(Mapping):
    """The children a node was loaded with, read-only: ``kids`` is one tuple of their
    first tokens, sorted, then the children in the same order (a tuple of ``2m``
    items instead of a dict: a third of the memory for a node with a thousand
    children, and of a small dict's). The node gets a dict when its children change."""

    __slots__ = ("kids",)

    def __init__(self, kids: tuple) -> None:
        self.kids = kids

    def get(self, token: int, default: Any = None) -> Any:
        child = _packed_child(self.kids, token)
        return default if child is None else child

    def __getitem__(self, token: int) -> RadixNode:
        child = _packed_child(self.kids, token)
        if child is None:
            raise KeyError(token)
        return child

    def __contains__(self, token: object) -> bool:
        try:
            return _packed_child(self.kids, token) is not None  # type: ignore[arg-type]
        except TypeError:  # (not a token)
            return False

    def __len__(self) -> int:
        return len(self.kids) >> 1

    def __iter__(self) -> Iterator[int]:
        return iter(self.kids[: len(self.kids) >> 1])

    def values(self) -> Any:
        return self.kids[len(self.kids) >> 1 :]


def _packed_child(kids: tuple, token: int) -> RadixNode | None:
    m = len(kids) >> 1
    i = bisect.bisect_left(kids, token, 0, m)
    return kids[m + i] if i < m and kids[i] == token else None


def _child(node: RadixNode, token: int) -> RadixNode | None:
    """The child of ``node`` whose tokens start with ``token``, if any."""
    kids = node._kids
    if kids is None:
        return None
    if type(kids) is dict:
        return kids.get(token)
    return _packed_child(kids, token)


_M32, _M48 = (1 << 32) - 1, (1 << 48) - 1


def _pack(node_id: int, file_id: int, off: int, file_row: int, n: int) -> int:
    """One int for a node's fixed fields: ``n`` and ``file_row`` (32 bits each), ``off``
    and ``file_id + 1`` (48 bits each) and the id above them."""
    if not (0 <= n <= _M32 and 0 <= file_row <= _M32 and 0 <= off <= _M48 and -1 <= file_id < _M48 and node_id >= 0):
        raise ValueError(f"node {node_id}: values out of range (file {file_id}, rows {file_row}+{n}, offset {off})")
    return (((((node_id << 48) | (file_id + 1)) << 48 | off) << 32 | file_row) << 32) | n


class RadixNode:
    """One edge of the tree and the rows that hold its tokens' K/V.

    Compact: the tokens are ``length`` ids from an offset on in a shared array
    (``tokens`` is a view made when asked for); the id, file, first row, offset and
    length are packed in one int (`_pack`: one object instead of five); a leaf has no
    children dict of its own, and a node loaded with children keeps them in one tuple
    (`_Packed`) until they change. ``parent`` and ``terminal`` change with the tree.
    """

    __slots__ = ("_key", "_buf", "parent", "_kids", "terminal")

    def __init__(
        self, node_id: int, tokens: np.ndarray, file_id: int, file_row: int, parent: RadixNode | None, terminal: int = 0
    ) -> None:
        self._key = _pack(node_id, file_id, 0, file_row, len(tokens))
        self._buf = tokens
        self.parent = parent
        self._kids: dict[int, RadixNode] | tuple | None = None
        #: number of stored sequences that end exactly at this node
        self.terminal = terminal

    @classmethod
    def view(
        cls, node_id: int, buf: np.ndarray, off: int, n: int, file_id: int, file_row: int, parent: RadixNode | None,
        terminal: int = 0,
    ) -> RadixNode:
        """A node whose tokens are ``buf[off : off + n]`` (no view made until asked)."""
        node = cls.__new__(cls)
        node._key, node._buf = _pack(node_id, file_id, off, file_row, n), buf
        node.parent, node._kids, node.terminal = parent, None, terminal
        return node

    @property
    def id(self) -> int:
        return self._key >> 160

    @property
    def file_id(self) -> int:
        return ((self._key >> 112) & _M48) - 1

    @property
    def file_row(self) -> int:
        return (self._key >> 32) & _M32

    @property
    def _off(self) -> int:
        return (self._key >> 64) & _M48

    @property
    def _n(self) -> int:
        return self._key & _M32

    @property
    def tokens(self) -> np.ndarray:
        """The node's token ids (a view; ``int32``, or ``uint16`` for nodes loaded from an
        index whose ids all fit)."""
        key = self._key
        off = (key >> 64) & _M48
        return self._buf[off : off + (key & _M32)]

    @property
    def children(self) -> Mapping[int, RadixNode]:
        """Children by their first token (change them through `RadixTree` only)."""
        kids = self._kids
        if kids is None:
            return _NO_CHILDREN
        return kids if type(kids) is dict else _Packed(kids)

    @children.setter
    def children(self, value: Mapping[int, RadixNode]) -> None:
        self._kids = value.kids if isinstance(value, _Packed) else dict(value) if value else None

    def _own_children(self) -> dict[int, RadixNode]:
        kids = self._kids
        if type(kids) is not dict:
            kids = self._kids = {} if kids is None else dict(zip(kids[: len(kids) >> 1], kids[len(kids) >> 1 :]))
        return kids

    @property
    def length(self) -> int:
        return self._key & _M32

    @property
    def depth(self) -> int:
        """Number of tokens from the root to the end of this node."""
        n, node = 0, self
        while node is not None:
            n += node._key & _M32
            node = node.parent
        return n

    def path(self) -> list[RadixNode]:
        """The nodes from the root (left out: it holds no tokens) down to this one."""
        out: list[RadixNode] = []
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def path_tokens(self) -> np.ndarray:
        """The tokens from the root to the end of this node."""
        path = self.path()
        return np.concatenate([n.tokens for n in path]) if path else np.zeros(0, np.int32)

    def is_leaf(self) -> bool:
        return not self._kids

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, file={self.file_id}, rows={self.file_row}+{self._n})"


@dataclass(frozen=True)
class Segment:
    """A run of matched tokens that lives in one node: rows ``file_row .. + length``."""

    node: RadixNode
    length: int

    @property
    def file_id(self) -> int:
        return self.node.file_id

    @property
    def file_row(self) -> int:
        return self.node.file_row


@dataclass(frozen=True)
class Match:
    """Result of `RadixTree.match`."""

    length: int
    segments: tuple[Segment, ...]
    #: seconds the store's lookup waited for a write in flight that this match needed
    #: (`ImpressStore.match`; 0.0 for the tree's own matches)
    waited_s: float = 0.0


@dataclass
class InsertPlan:
    """What inserting a sequence changes, before the index has committed it.

    ``split``: the node cut in two (``(node, k)``: a new upper node with its first ``k``
    tokens and a new lower node with the rest replace it); ``leaf``: the new leaf's
    ``(tokens, file_id, file_row)`` below the match (or ``None``); ``terminal``: the node
    whose count of stored sequences grows when nothing new is added.
    """

    matched: int
    parent: RadixNode
    split: tuple[RadixNode, int] | None
    leaf: tuple[np.ndarray, int, int] | None
    terminal: RadixNode | None


class RadixTree:
    """A token-prefix tree whose nodes point at rows of chunk files."""

    def __init__(self) -> None:
        self.root = RadixNode(0, np.zeros(0, np.int32), -1, 0, None)
        self._nodes = NodeTable({0: self.root})
        #: the index's change-log position the tree was read at (`Index.load_tree`;
        #: ``None``: not read from an index, or an index without a change log)
        self.log_seq: int | None = None

    @classmethod
    def from_columns(cls, nodes: np.ndarray, offsets: np.ndarray, buf: np.ndarray) -> RadixTree:
        """A tree from node rows ``(id, parent, file_id, file_row, length, terminal)``
        (``int64 [n, 6]``, any order) whose tokens are ``buf[offset : offset + length]``.
        `ValueError` when a row cannot be placed (no parent, a duplicate id or first
        token). Time proportional to the number of nodes: the nodes are built here,
        without per-node calls."""
        tree = cls()
        first_tok = buf[np.minimum(offsets, max(0, len(buf) - 1))] if len(buf) else np.zeros(len(nodes), np.int64)
        # children grouped by parent, by first token (one key of both while the parents
        # fit in 31 bits: a sort of one column)
        if len(nodes) and 0 <= nodes[:, 1].min() and nodes[:, 1].max() < 1 << 31:
            order = np.argsort((nodes[:, 1] << 32) | (first_tok.astype(np.int64) + (1 << 31)))
        else:
            order = np.lexsort((first_tok, nodes[:, 1]))
        nodes, offsets, first_tok = nodes[order], offsets[order], first_tok[order]
        parents = nodes[:, 1]
        twice = np.flatnonzero((parents[1:] == parents[:-1]) & (first_tok[1:] == first_tok[:-1]))
        if len(twice):
            j = int(twice[0]) + 1
            raise ValueError(f"node {int(nodes[j, 0])} cannot be placed below node {int(parents[j])}")
        keys, first = np.unique(parents, return_index=True)
        end = np.append(first[1:], len(parents))
        if len(nodes) and (
            nodes[:, 0].min() < 1 or nodes[:, 2].min() < -1 or nodes[:, 2].max() >= _M48 or nodes[:, 3].min() < 0
            or nodes[:, 3].max() > _M32 or nodes[:, 4].min() < 1 or nodes[:, 4].max() > _M32 or offsets.min() < 0
            or offsets.max() > _M48
        ):
            raise ValueError("a node's values are out of range")
        by_id = np.argsort(nodes[:, 0], kind="stable")
        ids = nodes[by_id, 0]
        if len(ids) > 1 and (ids[1:] == ids[:-1]).any():
            raise ValueError(f"node id {int(ids[1:][ids[1:] == ids[:-1]][0])} is used twice")
        terms = nodes[:, 5].tolist()
        packed = _packed(nodes[:, 0], nodes[:, 2], offsets, nodes[:, 3], nodes[:, 4])
        # one int object per distinct first token (the children's keys), handed out by numpy
        distinct, which = np.unique(first_tok, return_inverse=True)
        table = np.empty(len(distinct), object)
        table[:] = distinct.tolist()
        firsts = table[which.reshape(-1)].tolist()
        del table, which
        # each node's children: rows lo[j] .. hi[j] (an empty run for a leaf). No Python
        # int per node beyond what the nodes keep (the nodes stay in the order they are
        # built, found by id through ``rows``): such temporaries would leave Python's
        # small-object pools among the nodes' empty, and resident, when freed
        k = np.minimum(np.searchsorted(keys, nodes[:, 0]), max(0, len(keys) - 1))
        has = keys[k] == nodes[:, 0] if len(keys) else np.zeros(len(nodes), bool)
        inner, lo, hi = has.tolist(), first[k], end[k]
        root = int(np.searchsorted(keys, 0)) if len(keys) else 0
        by_row: list[RadixNode | None] = [None] * len(nodes)
        new, placed = RadixNode.__new__, 0
        stack = [(tree.root, int(first[root]), int(end[root]))] if len(keys) and keys[root] == 0 else []
        while stack:  # parents before their children
            parent, a, b = stack.pop()
            kids = []
            for j in range(a, b):
                node = new(RadixNode)
                node._key, node._buf, node.parent, node._kids, node.terminal = packed[j], buf, parent, None, terms[j]
                kids.append(node)
                if inner[j]:
                    stack.append((node, int(lo[j]), int(hi[j])))
            by_row[a:b] = kids
            parent._kids = (*firsts[a:b], *kids)  # (`_Packed`: sorted by first token)
            placed += b - a
        if placed != len(ids):
            raise ValueError(f"{len(ids) - placed} node(s) have no parent")
        small = len(ids) and ids[-1] < 1 << 32  # (ids and rows in four bytes while they fit)
        rows = by_id.astype(np.uint32) if len(by_id) < 1 << 32 else by_id
        tree._nodes = NodeTable({0: tree.root}, ids.astype(np.uint32) if small else ids, by_row, rows)
        return tree

    # -- queries ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes) - 1

    def node(self, node_id: int) -> RadixNode:
        return self._nodes[node_id]

    def get(self, node_id: int) -> RadixNode | None:
        return self._nodes.get(node_id)

    def nodes(self) -> Iterator[RadixNode]:
        """All nodes except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def leaf_ids(self) -> list[int]:
        """Ids of the nodes without children (the root excepted), in no order."""
        return [n.id for n in self._nodes.values() if not n._kids and n.parent is not None]

    def match(self, tokens: Sequence[int] | np.ndarray, limit: int | None = None) -> Match:
        """Longest stored prefix of ``tokens`` (at most ``limit`` tokens)."""
        arr = as_tokens(tokens)
        limit = len(arr) if limit is None else max(0, min(limit, len(arr)))
        segments: list[Segment] = []
        node, pos = self.root, 0
        while pos < limit:
            child = _child(node, int(arr[pos]))
            if child is None:
                break
            n = _common_length(child.tokens, arr[pos:limit])
            segments.append(Segment(child, n))
            pos += n
            if n < child._n:
                break
            node = child
        return Match(pos, tuple(segments))

    # -- updates -------------------------------------------------------------------------
    def plan_insert(
        self, tokens: Sequence[int] | np.ndarray, file_id: int, file_row_of_first_new: int = 0,
        file_tokens: np.ndarray | None = None,
    ) -> InsertPlan:
        """What storing ``tokens`` changes; the rows of the tokens not yet stored live in
        ``file_id`` from row ``file_row_of_first_new`` on. ``file_tokens`` (the file's
        token array) backs the new leaf's tokens; by default a copy of the new tokens."""
        arr = as_tokens(tokens)
        m = self.match(arr)
        parent, split, terminal = self.root, None, None
        if m.segments:
            last = m.segments[-1]
            parent = last.node
            if last.length < len(last.node.tokens):
                split = (last.node, last.length)
        leaf = None
        if m.length < len(arr):
            if file_tokens is None:
                leaf_tokens = arr[m.length :].copy()
            else:
                leaf_tokens = file_tokens[file_row_of_first_new : file_row_of_first_new + len(arr) - m.length]
            leaf = (leaf_tokens, file_id, file_row_of_first_new)
        elif split is None and m.segments:
            terminal = parent
        return InsertPlan(m.length, parent, split, leaf, terminal)

    def insert(
        self, tokens: Sequence[int] | np.ndarray, file_id: int, file_row_of_first_new: int = 0,
        file_tokens: np.ndarray | None = None,
    ) -> RadixNode | None:
        """Plan and apply an insert at once, with ids the tree chooses (for a tree that no
        index mirrors); returns the new leaf or ``None``."""
        plan = self.plan_insert(tokens, file_id, file_row_of_first_new, file_tokens)
        parent = plan.parent
        if plan.split is not None:
            parent, _ = self.split(plan.split[0], plan.split[1], self._next_id(), self._next_id() + 1)
            if plan.leaf is None:
                parent.terminal += 1
        if plan.leaf is not None:
            leaf_tokens, fid, row = plan.leaf
            return self.add_child(parent, leaf_tokens, fid, row, self._next_id(), terminal=1)
        if plan.terminal is not None:
            plan.terminal.terminal += 1
        return None

    def _next_id(self) -> int:
        return self._nodes.max_id() + 1

    def split(self, node: RadixNode, k: int, upper_id: int, lower_id: int) -> tuple[RadixNode, RadixNode]:
        """Replace ``node`` by an upper node (its first ``k`` tokens) and a lower node (the
        rest, with its children and terminal count). ``node`` itself is left as it was,
        detached, for requests that matched it."""
        if not 0 < k < node._n:
            raise ValueError(f"cannot split a node of {node._n} tokens at {k}")
        parent = node.parent
        assert parent is not None and parent.children.get(int(node.tokens[0])) is node
        upper = RadixNode.view(self._free(upper_id), node._buf, node._off, k, node.file_id, node.file_row, parent)
        lower = RadixNode.view(
            self._free(lower_id), node._buf, node._off + k, node._n - k, node.file_id, node.file_row + k, upper,
            node.terminal,
        )
        lower.children = node.children
        for child in lower.children.values():
            child.parent = lower
        upper._own_children()[int(lower.tokens[0])] = lower
        parent._own_children()[int(upper.tokens[0])] = upper
        self._nodes[upper.id] = upper
        self._nodes[lower.id] = lower
        del self._nodes[node.id]
        return upper, lower

    def replace(self, node: RadixNode, node_id: int, file_id: int, file_row: int) -> RadixNode:
        """Put a new node with ``node``'s tokens, children and terminal count, but rows
        ``file_row ..`` of ``file_id``, in its place (a rewrite of its rows). ``node``
        itself is left as it was, detached, for requests that matched it."""
        parent = node.parent
        assert parent is not None and parent.children.get(int(node.tokens[0])) is node
        new = RadixNode.view(self._free(node_id), node._buf, node._off, node._n, file_id, file_row, parent, node.terminal)
        new.children = node.children
        for child in new.children.values():
            child.parent = new
        parent._own_children()[int(node.tokens[0])] = new
        self._nodes[new.id] = new
        del self._nodes[node.id]
        return new

    def add_child(
        self, parent: RadixNode, tokens: np.ndarray, file_id: int, file_row: int, node_id: int, terminal: int = 0
    ) -> RadixNode:
        """Attach a new node below ``parent`` (its first token must be free there)."""
        tokens = as_tokens(tokens)
        if len(tokens) == 0:
            raise ValueError("a node needs at least one token")
        if int(tokens[0]) in parent.children:
            raise ValueError(f"parent {parent.id} already has a child starting with {int(tokens[0])}")
        node = RadixNode(self._free(node_id), tokens, file_id, file_row, parent, terminal)
        parent._own_children()[int(tokens[0])] = node
        self._nodes[node.id] = node
        return node

    def remove(self, node: RadixNode) -> None:
        """Delete a leaf node. Raises if it has children."""
        if node is self.root:
            raise ValueError("the root cannot be removed")
        if node.children:
            raise ValueError(f"node {node.id} has children; remove them first")
        parent = node.parent
        assert parent is not None and parent._kids is not None
        kids = parent._own_children()
        del kids[int(node._buf[node._off])]
        if not kids:
            parent._kids = None
        del self._nodes[node.id]

    def detach(self, node: RadixNode, keep: bool = True) -> None:
        """Take ``node`` (with its subtree) from its parent's children, for `attach` to put
        it elsewhere (``keep``) or to drop it (not ``keep``: its id is forgotten; its
        children stay under it until attached elsewhere)."""
        parent = node.parent
        if parent is not None and parent._kids is not None:
            kids = parent._own_children()
            first = int(node._buf[node._off])
            if kids.get(first) is node:
                del kids[first]
                if not kids:
                    parent._kids = None
        if not keep and self._nodes.get(node.id) is node:
            del self._nodes[node.id]

    def attach(self, parent: RadixNode, node: RadixNode) -> None:
        """Put a node (new, or taken out by `detach`) below ``parent``."""
        first = int(node._buf[node._off])
        kids = parent._own_children()
        if first in kids and kids[first] is not node:
            raise ValueError(f"parent {parent.id} already has a child starting with {first}")
        kids[first] = node
        node.parent = parent
        if self._nodes.get(node.id) is not node:
            self._nodes[node.id] = node

    def subtree(self, node: RadixNode) -> list[RadixNode]:
        """``node`` and all its descendants, children before parents."""
        out: list[RadixNode] = []
        stack = [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out[::-1]

    def _free(self, node_id: int) -> int:
        if node_id in self._nodes:
            raise ValueError(f"node id {node_id} is already used")
        return node_id


def _packed(ids: np.ndarray, file_ids: np.ndarray, offs: np.ndarray, rows: np.ndarray, ns: np.ndarray) -> list[int]:
    """`_pack` of columns (checked in range), without Python arithmetic per node while the
    ids fit in 32 bits: three 64-bit words per node, read as one int."""
    if not len(ids) or ids.max() >= 1 << 32:
        return [_pack(*v) for v in zip(ids.tolist(), file_ids.tolist(), offs.tolist(), rows.tolist(), ns.tolist())]
    u = np.uint64
    fid = (file_ids + 1).astype(u)
    words = np.empty((len(ids), 3), "<u8")
    words[:, 0] = (rows.astype(u) << u(32)) | ns.astype(u)
    words[:, 1] = offs.astype(u) | ((fid & u(0xFFFF)) << u(48))
    words[:, 2] = (fid >> u(16)) | (ids.astype(u) << u(32))
    raw, fb = words.tobytes(), int.from_bytes
    return [fb(raw[k : k + 24], "little") for k in range(0, len(raw), 24)]


def _common_length(edge: np.ndarray, tokens: np.ndarray) -> int:
    n = min(len(edge), len(tokens))
    if n == 0:
        return 0
    diff = np.flatnonzero(edge[:n] != tokens[:n])
    return int(diff[0]) if len(diff) else n
