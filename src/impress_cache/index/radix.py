"""Radix tree over token ids: which stored prefix matches a prompt, and where its rows live.

Pure Python, no torch. Every node is an edge label (a run of token ids) plus the
location of those tokens' K/V rows: rows ``file_row .. file_row + len(tokens)`` of chunk
file ``file_id``. The tree holds every prefix of every inserted sequence, so a prompt
that diverges in the middle of a stored one still matches their common part.

Splitting a node never rewrites data: the upper half keeps the first rows of the same
file and the lower half points further into it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree and the rows that hold its tokens' K/V."""

    id: int
    tokens: tuple[int, ...]
    file_id: int
    file_row: int
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)
    #: number of stored sequences that end exactly at this node
    terminal: int = 0
    #: requests currently using this node (never deleted while > 0)
    lock_ref: int = 0

    @property
    def depth(self) -> int:
        """Number of tokens from the root to the end of this node."""
        n, node = 0, self
        while node is not None:
            n += len(node.tokens)
            node = node.parent
        return n

    def is_leaf(self) -> bool:
        return not self.children


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
    """Result of `match`."""

    length: int
    segments: tuple[Segment, ...]


class RadixTree:
    """A token-prefix tree whose nodes point at rows of chunk files.

    The root has no tokens. Node ids are allocated by the tree (``next_id``) unless the
    caller passes them, so an index can rebuild the same tree on reopen.
    """

    def __init__(self) -> None:
        self.root = RadixNode(id=0, tokens=(), file_id=-1, file_row=0)
        self._nodes: dict[int, RadixNode] = {0: self.root}
        self.next_id = 1

    # -- queries ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes) - 1

    def node(self, node_id: int) -> RadixNode:
        return self._nodes[node_id]

    def nodes(self) -> Iterator[RadixNode]:
        """All nodes except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """Longest stored prefix of ``tokens`` (at most ``limit`` tokens)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        segments: list[Segment] = []
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_length(child.tokens, tokens, pos, limit)
            segments.append(Segment(child, n))
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return Match(pos, tuple(segments))

    # -- updates ---------------------------------------------------------------------
    def split(self, node: RadixNode, k: int, new_id: int | None = None) -> RadixNode:
        """Cut ``node`` after ``k`` tokens; return the new upper node.

        The upper node takes ``node``'s place under its parent and keeps the first
        ``k`` rows; ``node`` keeps its id, children and the remaining rows.
        """
        if not 0 < k < len(node.tokens):
            raise ValueError(f"cannot split a node of {len(node.tokens)} tokens at {k}")
        upper = RadixNode(
            id=self._take_id(new_id),
            tokens=node.tokens[:k],
            file_id=node.file_id,
            file_row=node.file_row,
            parent=node.parent,
        )
        assert node.parent is not None
        node.parent.children[upper.tokens[0]] = upper
        node.tokens = node.tokens[k:]
        node.file_row += k
        node.parent = upper
        upper.children[node.tokens[0]] = node
        self._nodes[upper.id] = upper
        return upper

    def add_child(
        self,
        parent: RadixNode,
        tokens: Sequence[int],
        file_id: int,
        file_row: int = 0,
        node_id: int | None = None,
        terminal: int = 0,
    ) -> RadixNode:
        """Attach a new node below ``parent`` (its first token must be free there)."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            raise ValueError("a node needs at least one token")
        if tokens[0] in parent.children:
            raise ValueError(f"parent {parent.id} already has a child starting with {tokens[0]}")
        node = RadixNode(
            id=self._take_id(node_id),
            tokens=tokens,
            file_id=file_id,
            file_row=file_row,
            parent=parent,
            terminal=terminal,
        )
        parent.children[tokens[0]] = node
        self._nodes[node.id] = node
        return node

    def insert(
        self, tokens: Sequence[int], file_id: int, file_row_of_first_new: int = 0
    ) -> tuple[int, RadixNode | None, RadixNode | None]:
        """Store ``tokens``; the rows of the tokens not yet stored live in ``file_id``.

        Returns ``(matched, upper, leaf)``: how many tokens were already stored, the
        upper node created by a split (or None) and the new leaf (or None when
        everything was stored already). Row ``file_row_of_first_new`` of the file holds
        token ``matched``.
        """
        tokens = tuple(int(t) for t in tokens)
        m = self.match(tokens)
        upper = None
        parent = self.root
        if m.segments:
            last = m.segments[-1]
            parent = last.node
            if last.length < len(last.node.tokens):
                upper = self.split(last.node, last.length)
                parent = upper
        if m.length == len(tokens):
            if tokens:
                parent.terminal += 1
            return m.length, upper, None
        leaf = self.add_child(parent, tokens[m.length :], file_id, file_row_of_first_new, terminal=1)
        return m.length, upper, leaf

    def remove(self, node: RadixNode) -> None:
        """Delete a leaf node. Raises if it has children or is in use."""
        if node is self.root:
            raise ValueError("the root cannot be removed")
        if node.children:
            raise ValueError(f"node {node.id} has children; remove them first")
        if node.lock_ref > 0:
            raise ValueError(f"node {node.id} is in use by {node.lock_ref} request(s)")
        assert node.parent is not None
        del node.parent.children[node.tokens[0]]
        del self._nodes[node.id]
        node.parent = None

    def subtree(self, node: RadixNode) -> list[RadixNode]:
        """``node`` and all its descendants, children before parents."""
        out: list[RadixNode] = []
        stack = [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out[::-1]

    def _take_id(self, node_id: int | None) -> int:
        if node_id is None:
            node_id = self.next_id
        if node_id in self._nodes:
            raise ValueError(f"node id {node_id} is already used")
        self.next_id = max(self.next_id, node_id + 1)
        return node_id


def _common_length(edge: tuple[int, ...], tokens: Sequence[int], pos: int, limit: int) -> int:
    n = min(len(edge), limit - pos)
    i = 0
    while i < n and edge[i] == tokens[pos + i]:
        i += 1
    return i
