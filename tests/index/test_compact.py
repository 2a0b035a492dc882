"""The compact in-memory form of a store's metadata: the tree and the file table that
`Index.load_tree` builds (one token buffer, file records as columns, compact nodes) must
say exactly what the index says, after any sequence of writes, splits, rewrites and
removals, and stay small."""

from __future__ import annotations

import gc
import re
import tracemalloc
import uuid

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from impress_cache.errors import StoreFormatError
from impress_cache.index.schema import INVARIANT_NAMES
from impress_cache.index.files import FileTable, find_sorted
from impress_cache.index.sqlite import Index, NewFile
from impress_cache.store.catalog import CHUNK_DIR, Catalog
from impress_cache.store.changes import TreeChanges


def new_file(tokens, first_pos: int, name: str | None = None) -> NewFile:
    toks = np.asarray(tokens, np.int32)
    blocks = -(-len(toks) // 4)
    return NewFile(
        name=name or f"{uuid.uuid4().hex}.safetensors", format="safetensors", first_pos=first_pos, tokens=toks,
        context=bytes(range(32)), chunk_tokens=4, layers=2, offsets=np.zeros((2, 2, blocks), np.int64),
        checksums=np.zeros((2, 2, blocks), np.uint32), nbytes=100 * len(toks), file_bytes=4096 + len(toks),
    )


def make_catalog(tmp_path) -> Catalog:
    (tmp_path / CHUNK_DIR).mkdir(exist_ok=True)
    return Catalog(tmp_path, Index(tmp_path / "index.sqlite"), (64, 8), lambda ids, recs: None)


def store_prompt(cat: Catalog, tokens) -> None:
    matched = cat.tree.match(tokens).length
    if matched < len(tokens):  # (a prompt stored already writes nothing)
        cat.commit_prompt(tokens, matched, new_file(tokens[matched:], matched))


def snapshot(tree) -> set[tuple]:
    return {
        (n.id, n.parent.id, n.file_id, n.file_row, tuple(int(t) for t in n.tokens), n.terminal) for n in tree.nodes()
    }


def same_record(a, b) -> bool:
    return (
        (a.id, a.name, a.format, a.first_pos, a.n_tokens, a.chunk_tokens, a.layers, a.nbytes, a.file_bytes,
         a.context, a.reordered)
        == (b.id, b.name, b.format, b.first_pos, b.n_tokens, b.chunk_tokens, b.layers, b.nbytes, b.file_bytes,
            b.context, b.reordered)
        and a.tokens.dtype == np.int32 and np.array_equal(a.tokens, b.tokens)
    )


def check_against_index(cat: Catalog, covered: set[tuple]) -> None:
    tree, files = cat.index.load_tree()
    assert snapshot(tree) == snapshot(cat.tree)
    indexed = {f.id: f for f in cat.index.files()}
    for table in (files, cat.records):  # the loaded table and the live one (with records added since)
        assert set(table) == set(indexed) and len(table) == len(indexed)
        for fid, rec in indexed.items():
            assert fid in table and same_record(table[fid], rec) and same_record(table.get(fid), rec)
        assert table.file_bytes == sum(r.file_bytes for r in indexed.values())
        assert table.names() == {r.name for r in indexed.values()}
        check_unlisted(table, indexed)
    assert -1 not in files and files.get(10**9) is None
    for s in covered:  # every stored prefix matches in the loaded tree, through the same rows
        m, m2 = tree.match(s), cat.tree.match(s)
        assert m.length == len(s) == m2.length
        assert [(g.file_id, g.file_row, g.length) for g in m.segments] == [
            (g.file_id, g.file_row, g.length) for g in m2.segments
        ]
    assert sum(n.length for n in tree.nodes()) == len(covered)


def check_unlisted(table: FileTable, indexed: dict) -> None:
    """`FileTable.unlisted` leaves out exactly the standard names of the files in its columns."""
    standard = {
        r.name for fid, r in indexed.items() if fid not in table._added and re.fullmatch(r"[0-9a-f]{32}\.(safetensors|h5)", r.name)
    }
    names = [r.name for r in indexed.values()]
    for r in list(indexed.values())[:3]:  # near misses of indexed names
        stem, _, suffix = r.name.partition(".")
        names += [stem.upper() + "." + suffix, stem + ".h5" if suffix != "h5" else stem + ".safetensors", stem + ".", "x" + r.name[1:]]
    names += [uuid.uuid4().hex + ".safetensors", "é" * 32 + ".h5", "", "a.tmp", uuid.uuid4().hex + ".safetensors.tmp"]
    expected = [n for n in names if n not in standard]
    assert table.unlisted([names], ("safetensors", "h5")) == expected
    assert table.unlisted([names[:5], [], names[5:]], ("safetensors", "h5")) == expected


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 3), min_size=1, max_size=10)),
        st.tuples(st.just("remove"), st.integers(0, 10**6)),
        st.tuples(st.just("rewrite"), st.integers(0, 10**6)),
        st.tuples(st.just("reload"), st.just(0)),
    ),
    min_size=1, max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, big=st.booleans())
def test_loaded_tree_and_files_are_what_the_index_says(tmp_path_factory, ops, big):
    """A reference of stored prefixes (tuples) against the live tree, the tree and file
    table loaded from the index, and their matches; ``big`` token ids (past 65,535) keep
    the buffer in four bytes per token."""
    cat = make_catalog(tmp_path_factory.mktemp("c"))
    base = 70_000 if big else 0
    covered: set[tuple] = set()
    try:
        for op, arg in ops:
            if op == "put":
                seq = tuple(base + t for t in arg)
                store_prompt(cat, seq)
                covered.update(seq[:i] for i in range(1, len(seq) + 1))
            elif op == "remove" and len(cat.tree):
                leaves = sorted((n for n in cat.tree.nodes() if n.is_leaf()), key=lambda n: n.id)
                node = leaves[arg % len(leaves)]
                path, n = [], node
                while n.parent is not None:
                    path[:0] = [int(t) for t in n.tokens]
                    n = n.parent
                changes = TreeChanges()
                with cat.transaction() as tx:  # (the tree follows once committed)
                    changes.remove_leaf(cat, tx.conn, node)
                    changes.drop_file_if_unreferenced(cat, tx.conn, node.file_id)
                covered -= {tuple(path[:i]) for i in range(len(path) - node.length + 1, len(path) + 1)}
            elif op == "rewrite" and len(cat.tree):
                nodes = sorted(cat.tree.nodes(), key=lambda n: n.id)
                node = nodes[arg % len(nodes)]
                depth = node.depth - node.length
                assert cat.replace_node(node, new_file(node.tokens, depth)) is not None
            elif op == "reload":
                cat.reload_tree()
            check_against_index(cat, covered)
        if big and len(cat.tree):
            assert cat.index.load_tree()[1].tokens.dtype == np.int32
        elif len(cat.tree):
            assert cat.index.load_tree()[1].tokens.dtype == np.uint16
    finally:
        cat.close()
        cat.index.close()


def test_odd_names_and_formats_round_trip(tmp_path):
    """Names the columns cannot hold as 16 bytes and a suffix are kept as they are."""
    cat = make_catalog(tmp_path)
    store_prompt(cat, (1, 2, 3))
    with cat.index.transaction() as conn:
        odd = cat.index.add_file(conn, new_file((5, 6), 0, name="not-a-chunk-name.bin"))
        spaced = cat.index.add_file(conn, new_file((3, 4), 0, name="ab " + "c" * 29 + ".safetensors"))
        nl = cat.index.add_file(conn, new_file((2, 4), 0, name="d" * 32 + ".h5\n"))
        cat.index.add_node(conn, 0, spaced, 0, 2, 1)
        cat.index.add_node(conn, 0, nl, 0, 2, 1)
        h5 = cat.index.add_file(conn, new_file((7, 8), 0, name=f"{uuid.uuid4().hex}.h5"))
        cat.index.add_node(conn, 0, odd, 0, 2, 1)
        cat.index.add_node(conn, 0, h5, 0, 2, 1)
    cat.reload_tree()
    assert cat.records[odd].name == "not-a-chunk-name.bin"
    assert cat.records[h5].name.endswith(".h5")
    assert cat.records[spaced].name == "ab " + "c" * 29 + ".safetensors"
    assert cat.records[nl].name == "d" * 32 + ".h5\n"
    check_against_index(cat, {(1,), (1, 2), (1, 2, 3), (5,), (5, 6), (7,), (7, 8), (3,), (3, 4), (2,), (2, 4)})
    cat.close()
    cat.index.close()


@pytest.mark.parametrize("damage", ["rows", "orphan", "tokens"])
def test_damaged_rows_are_refused(tmp_path, damage):
    cat = make_catalog(tmp_path)
    store_prompt(cat, (1, 2, 3))
    with cat.index.transaction() as conn:
        for name in INVARIANT_NAMES:  # (damage on disk does not go through SQL: the triggers never see it)
            conn.execute(f"DROP TRIGGER {name}")
        if damage == "rows":
            conn.execute("UPDATE nodes SET length=99")
        elif damage == "orphan":
            conn.execute("UPDATE nodes SET parent=12345")
        else:
            conn.execute("UPDATE files SET tokens=x'0100'")
    with pytest.raises(StoreFormatError):
        cat.index.load_tree()
    cat.close()
    cat.index.close()


def test_memory_per_node_stays_small(tmp_path):
    """5,000 stored prompts of 80 tokens each (a shared part of 20, 60 of their own): the
    loaded tree and file table take under 8 bytes per stored token, as traced by
    tracemalloc (packed nodes, a node table of columns, the files' context digests kept
    once each and a node's loaded children in one tuple)."""
    index = Index(tmp_path / "index.sqlite")
    rng = np.random.default_rng(0)
    n, tokens = 5000, 0
    with index.transaction() as conn:
        fid = index.add_file(conn, new_file(rng.integers(0, 50_000, 20), 0))
        top = index.add_node(conn, 0, fid, 0, 20, 0)
        tokens += 20
        for i in range(n):  # distinct first tokens: every prompt is a child of the shared part
            fid = index.add_file(conn, new_file(np.r_[i, rng.integers(0, 50_000, 59)], 20))
            index.add_node(conn, top, fid, 0, 60, 1)
            tokens += 60
    gc.collect()
    tracemalloc.start()
    try:
        tree, files = index.load_tree()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(tree) == n + 1 and len(files) == n + 1
    assert files.tokens.dtype == np.uint16
    assert held / tokens < 8, f"{held / tokens:.1f} bytes per stored token"
    index.close()


def test_empty_table():
    t = FileTable()
    assert len(t) == 0 and list(t) == [] and t.get(1) is None and 1 not in t and t.file_bytes == 0
    with pytest.raises(KeyError):
        t[1]


def test_statistics_go_with_their_node_and_file_also_in_an_older_index(tmp_path):
    """A node's and a file's saved statistics are deleted with them (triggers), also in an
    index made before the triggers existed (they are added when it is opened)."""
    path = tmp_path / "index.sqlite"
    index = Index(path)
    with index.transaction() as conn:
        conn.execute("DROP TRIGGER node_removed")  # an index of the version before
        conn.execute("DROP TRIGGER file_removed")
    index.close()
    index = Index(path)
    with index.transaction() as conn:
        fids = [index.add_file(conn, new_file(np.arange(4) + 10 * i, 0)) for i in range(2)]
        nodes = [index.add_node(conn, 0, fid, 0, 4, 1) for fid in fids]
    index.save_statistics(0.0, nodes={n: {"count": 1} for n in nodes}, blocks={(fid, 0, 0, 0): {"count": 1} for fid in fids})
    with index.transaction() as conn:
        index.delete_node(conn, nodes[0])
        assert index.delete_file_if_unreferenced(conn, fids[0])
        assert not index.delete_file_if_unreferenced(conn, fids[1])  # node 1 still needs it
    rows = index._conn.execute("SELECT node_id FROM node_stats").fetchall()
    assert rows == [(nodes[1],)]
    assert index._conn.execute("SELECT file_id FROM block_stats").fetchall() == [(fids[1],)]
    assert [r.id for r in index.files()] == [fids[1]]
    index.close()


def test_context_digests_are_kept_once_each():
    """Files share a row of context digests when their digests are equal; digests that
    share their first eight bytes but differ after them are kept apart."""
    from impress_cache.index.files import _dedupe

    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, (6, 32)).astype(np.uint8)
    rows[3] = rows[0]
    rows[5] = rows[1]
    table, index = _dedupe(rows)
    assert len(table) == 4 and np.array_equal(table[index], rows)
    rows[4, :8] = rows[2, :8]  # same first eight bytes, different rest
    table, index = _dedupe(rows)
    assert np.array_equal(table[index], rows)
    assert _dedupe(rows[:0])[0].shape == (0, 32)


_M32, _M48 = (1 << 32) - 1, (1 << 48) - 1
node_values = st.tuples(
    st.one_of(st.integers(1, 2**20), st.integers(2**32 - 2, 2**32 + 2), st.integers(1, 2**62)),  # id
    st.one_of(st.integers(-1, 2**16 + 2), st.integers(_M48 - 3, _M48 - 1)),  # file id
    st.one_of(st.integers(0, 2**17), st.integers(_M48 - 3, _M48)),  # offset
    st.one_of(st.integers(0, 300), st.integers(_M32 - 3, _M32)),  # first row
    st.one_of(st.integers(1, 300), st.integers(_M32 - 3, _M32)),  # length
)


@settings(max_examples=80, deadline=None)
@given(st.lists(node_values, min_size=1, max_size=30, unique_by=lambda v: v[0]), st.data())
def test_packed_nodes_and_node_table_against_tuples(values, data):
    """A node's packed fields read back as the tuple they were given, built one by one or
    from columns (`_packed`), and the node table answers as a dict of them does through
    removals and additions."""
    from impress_cache.index.nodetable import NodeTable
    from impress_cache.index.radix import RadixNode, _pack, _packed

    buf = np.zeros(4, np.int32)
    cols = [np.array(c, np.int64) for c in zip(*values)]
    assert _packed(*cols) == [_pack(*v) for v in values]
    for v, key in zip(values, _packed(*cols)):
        node = RadixNode.view(v[0], buf, v[2], v[4], v[1], v[3], None)
        assert (node.id, node.file_id, node._off, node.file_row, node.length) == v and node._key == key
    with pytest.raises(ValueError):
        _pack(1, _M48, 0, 0, 1)
    order = np.argsort(cols[0])
    nodes = [RadixNode.view(v[0], buf, v[2], v[4], v[1], v[3], None) for v in values]
    if data.draw(st.booleans()):  # nodes in id order
        table = NodeTable({0: "root"}, cols[0][order], [nodes[i] for i in order])
    else:  # nodes in the order they were built, found through the rows of the ids
        table = NodeTable({0: "root"}, cols[0][order], list(nodes), order.astype(np.uint32))
    ref = {0: "root", **{v[0]: n for v, n in zip(values, nodes)}}
    for _ in range(data.draw(st.integers(0, 20))):
        node_id = data.draw(st.sampled_from(sorted(ref)) | st.integers(0, 2**63))
        if data.draw(st.booleans()) and node_id in ref and node_id != 0:
            del table[node_id], ref[node_id]
        elif node_id not in ref:
            with pytest.raises(KeyError):
                del table[node_id]
            table[node_id] = ref[node_id] = RadixNode.view(node_id, buf, 0, 1, 0, 0, None)
        assert len(table) == len(ref) and (node_id in table) == (node_id in ref)
        assert table.get(node_id) is ref.get(node_id)
        assert sorted(map(id, table.values())) == sorted(map(id, ref.values()))
        if len(ref) > 1:
            assert table.max_id() == max(k for k in ref if k != 0 or len(ref) == 1)


def test_loaded_children_are_one_sorted_tuple_until_they_change():
    """A node loaded with children keeps them in one tuple (first tokens sorted, then the
    children) that answers as the dict did; the first change gives it a dict."""
    from impress_cache.index.radix import RadixTree

    buf = np.array([5, 9, 3, 7, 1, 2], np.uint16)
    # (id, parent, file, row, length, terminal): node 1 (token 5) has children 2..5,
    # whose first tokens are 9, 3, 7, 1 in row order
    rows = np.array([[1, 0, 0, 0, 1, 0], [2, 1, 0, 1, 1, 1], [3, 1, 0, 2, 1, 1], [4, 1, 0, 3, 1, 1], [5, 1, 0, 4, 2, 1]])
    tree = RadixTree.from_columns(rows, rows[:, 3].copy(), buf)
    top = tree.node(1)
    assert type(top._kids) is tuple and tree.node(5)._kids is None
    kids = top.children
    assert list(kids) == [1, 3, 7, 9] and [n.id for n in kids.values()] == [5, 3, 4, 2] and len(kids) == 4
    assert kids[7] is tree.node(4) and kids.get(8) is None and 3 in kids and 4 not in kids and "x" not in kids
    assert dict(kids.items()) == {1: tree.node(5), 3: tree.node(3), 7: tree.node(4), 9: tree.node(2)}
    assert [s.node.id for s in tree.match([5, 1, 2]).segments] == [1, 5] and tree.match([5, 4]).length == 1
    # a change: a dict with the same children and the new one
    tree.add_child(top, np.array([4], np.int32), 1, 0, node_id=6)
    assert type(top._kids) is dict and sorted(top.children) == [1, 3, 4, 7, 9]
    assert tree.match([5, 4]).length == 2
    # removals down to none, starting from a tuple again
    tree = RadixTree.from_columns(rows, rows[:, 3].copy(), buf)
    for node_id in (2, 3, 4, 5):
        tree.remove(tree.node(node_id))
    assert tree.node(1).is_leaf() and tree.node(1)._kids is None and tree.match([5, 9]).length == 1
    # a split of a node loaded with children hands the tuple on to the lower half
    tree = RadixTree.from_columns(np.array([[1, 0, 0, 0, 2, 0], [2, 1, 0, 2, 1, 1]]), np.array([0, 2]), buf)
    upper, lower = tree.split(tree.node(1), 1, 10, 11)
    assert lower.children[3] is tree.node(2) and tree.node(2).parent is lower and tree.match([5, 9, 3]).length == 3
    # two children with one first token: the index is damaged
    with pytest.raises(ValueError, match="cannot be placed"):
        RadixTree.from_columns(np.array([[1, 0, 0, 0, 1, 0], [2, 0, 0, 0, 1, 0]]), np.array([0, 0]), buf)


def test_listing_is_matched_on_whole_names_with_shared_leading_bytes_and_zeros(tmp_path):
    """`FileTable.unlisted` compares all 16 bytes of a name: names that share their first
    eight bytes, or differ only in zero bytes at the end, are told apart."""
    index = Index(tmp_path / "index.sqlite")
    stems = ["0" * 32, "0" * 30 + "01", "ab" * 8 + "0" * 16, "ab" * 8 + "0" * 15 + "1", "ab" * 8 + "f" * 16]
    with index.transaction() as conn:
        for k, stem in enumerate(stems[:4]):
            index.add_node(conn, 0, index.add_file(conn, new_file((k + 1, 9), 0, name=stem + ".safetensors")), 0, 2, 1)
    _, files = index.load_tree()
    listing = [s + ".safetensors" for s in stems] + ["0" * 28 + "0100.safetensors", stems[0] + ".h5"]
    assert files.unlisted([listing], ("safetensors", "h5")) == listing[4:]
    index.close()


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.int64]),
    st.lists(st.integers(-(2**31), 2**32), max_size=40, unique=True),
    st.lists(st.integers(-(2**40), 2**40), max_size=20),
)
def test_find_sorted_is_a_lookup_in_any_width(dtype, values: list[int], probes: list[int]) -> None:
    """`find_sorted` finds exactly the values of a narrowed sorted column, and none of
    the values outside it (also those the column's type cannot hold)."""
    info = np.iinfo(dtype)
    column = np.array(sorted(v for v in values if info.min <= v <= info.max), dtype)
    where = {int(v): i for i, v in enumerate(column.tolist())}
    for v in [*probes, *where, info.min - 1, info.max + 1]:
        assert find_sorted(column, v) == where.get(v, -1)


def test_lookups_do_not_copy_the_columns() -> None:
    """A lookup by id in a narrow column (the file table's ids, the tree's loaded node ids)
    is a binary search of the column as it is: a Python int as the key would convert the
    whole column to 64-bit integers first, a copy per lookup (O(n) time and memory)."""
    column = np.arange(0, 2_000_000, 2, dtype=np.uint32)
    tracemalloc.start()
    try:
        for v in (0, 1, 777_776, 1_999_998, 5_000_000):
            find_sorted(column, v)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak  # the copy would take 8 MB
