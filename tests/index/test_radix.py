"""The radix tree against a plain model: a set of stored sequences."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import numpy as np

from impress_cache.index.radix import RadixTree

# a small alphabet makes shared prefixes and mid-node splits common
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12).map(tuple)


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixModel(RuleBasedStateMachine):
    """Model: the set of every token prefix the tree holds (a dict of tuples)."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree()
        self.covered: set[tuple[int, ...]] = set()
        self.next_file = 0

    def _model_match(self, q, limit):
        n = 0
        while n < min(limit, len(q)) and tuple(q[: n + 1]) in self.covered:
            n += 1
        return n

    @rule(s=seqs)
    def insert(self, s):
        expect = self._model_match(s, len(s))
        before = [(n.id, n.file_id, n.file_row, tuple(n.tokens)) for n in self.tree.nodes()]
        plan = self.tree.plan_insert(s, file_id=self.next_file)
        assert plan.matched == expect
        assert [(n.id, n.file_id, n.file_row, tuple(n.tokens)) for n in self.tree.nodes()] == before  # planning changes nothing
        old = {n.id: (n, n.file_id, n.file_row, tuple(n.tokens)) for n in self.tree.nodes()}
        leaf = self.tree.insert(s, file_id=self.next_file)
        assert (leaf is None) == (expect == len(s))
        if leaf is not None:
            assert (leaf.file_id, leaf.file_row) == (self.next_file, 0)
        # copy-on-write: no node object that was in the tree changed its rows
        for node, fid, row, toks in old.values():
            assert (node.file_id, node.file_row, tuple(node.tokens)) == (fid, row, toks)
        self.covered.update(tuple(s[:i]) for i in range(1, len(s) + 1))
        self.next_file += 1

    @rule(q=seqs, limit=st.integers(0, 14))
    def match(self, q, limit):
        m = self.tree.match(q, limit=limit)
        assert m.length == self._model_match(q, limit)
        assert sum(seg.length for seg in m.segments) == m.length
        # the segments spell out the query's prefix
        spelled = [t for seg in m.segments for t in seg.node.tokens[: seg.length]]
        assert tuple(spelled) == tuple(q[: m.length])

    @precondition(lambda self: self.covered)
    @rule(data=st.data())
    def delete_leaf(self, data):
        leaves = sorted((n for n in self.tree.nodes() if n.is_leaf()), key=lambda n: n.id)
        node = data.draw(st.sampled_from(leaves))
        path: list[int] = []
        n = node
        while n.parent is not None:
            path[:0] = n.tokens.tolist()
            n = n.parent
        cut = len(path) - len(node.tokens)
        self.tree.remove(node)
        self.covered -= {tuple(path[:i]) for i in range(cut + 1, len(path) + 1)}

    @invariant()
    def structure(self):
        for node in self.tree.nodes():
            assert len(node.tokens), "empty node"
            assert node.parent is not None and node.parent.children[int(node.tokens[0])] is node
            assert node.file_row >= 0

    @invariant()
    def everything_covered_matches(self):
        for s in self.covered:
            assert self.tree.match(s).length == len(s)
        assert sum(len(n.tokens) for n in self.tree.nodes()) == len(self.covered)


TestRadix = RadixModel.TestCase
TestRadix.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_split_is_copy_on_write_and_keeps_rows():
    tree = RadixTree()
    tree.insert((1, 2, 3, 4, 5), file_id=7)
    before = tree.match((1, 2, 3, 4, 5))
    old = before.segments[0].node
    leaf = tree.insert((1, 2, 9), file_id=8)
    assert leaf is not None and (leaf.file_id, leaf.file_row, leaf.tokens.tolist()) == (8, 0, [9])
    upper = leaf.parent
    lower = upper.children[3]
    assert (upper.file_id, upper.file_row, upper.tokens.tolist()) == (7, 0, [1, 2])
    assert (lower.file_id, lower.file_row, lower.tokens.tolist()) == (7, 2, [3, 4, 5])
    assert old.id not in (upper.id, lower.id) and tree.get(old.id) is None
    # a request that matched before the split still reads exactly the rows it matched
    seg = before.segments[0]
    assert (seg.file_id, seg.file_row, seg.length, seg.node.tokens.tolist()) == (7, 0, 5, [1, 2, 3, 4, 5])
    m = tree.match((1, 2, 3, 4, 0))
    assert [(s.file_id, s.file_row, s.length) for s in m.segments] == [(7, 0, 2), (7, 2, 2)]


def test_a_nodes_path_runs_from_the_root():
    """`RadixNode.path`/`path_tokens` (the uploads' and the reorganiser's walk): the nodes
    and tokens from the root (left out) to the end of the node."""
    tree = RadixTree()
    tree.insert((1, 2, 3, 4, 5), file_id=7)
    leaf = tree.insert((1, 2, 9), file_id=8)
    upper = leaf.parent
    assert [n.id for n in leaf.path()] == [upper.id, leaf.id]
    assert leaf.path_tokens().tolist() == [1, 2, 9]
    assert upper.children[3].path_tokens().tolist() == [1, 2, 3, 4, 5]
    assert tree.root.path() == [] and len(tree.root.path_tokens()) == 0


def test_node_tokens_are_views_of_the_file_tokens():
    tree = RadixTree()
    file_tokens = np.array([5, 6, 7, 8], dtype=np.int32)
    tree.insert((1, 2), file_id=2)
    leaf = tree.insert((1, 2, 5, 6, 7, 8), file_id=3, file_row_of_first_new=0, file_tokens=file_tokens)
    assert leaf is not None and np.shares_memory(leaf.tokens, file_tokens)
    assert tree.match([1, 2, 5, 6, 7, 8, 9]).length == 6
