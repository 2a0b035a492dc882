"""Applying the index's change log to the in-memory radix tree and file table.

The index's triggers (`schema.CHANGE_LOG`) append the id of every node and file row
that a transaction inserts, updates or deletes to the ``changes`` table. A process that
sees another's commit reads the ids logged since its tree's position, with the current
rows of those ids (`Index.changes_since`: one read snapshot), and `apply_changes` brings
the tree and file table to that state: rows that are gone leave the tree, new rows join
it, moved rows (a split's reparented children) move, and terminal counts are set. The
result depends only on the rows' current state, not on the order of the changes, so
applying changes this process already applied itself (its own commits are logged too)
changes nothing. What cannot be placed (a parent that is neither in the tree nor among
the changes) raises `ValueError`: the caller reloads the whole tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .files import FileRecord, FileTable
from .radix import RadixNode, RadixTree, as_tokens


@dataclass
class ChangeSet:
    """The change log after a position: the touched ids and the current rows of those
    still in the index (node rows ``(id, parent, file_id, file_row, length, terminal)``)."""

    #: the log's last entry (the position after applying this)
    seq: int
    node_ids: set[int] = field(default_factory=set)
    nodes: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    file_ids: set[int] = field(default_factory=set)
    files: list[FileRecord] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.node_ids or self.file_ids)


@dataclass
class Applied:
    """What `apply_changes` did, for the catalog's listeners."""

    #: records of the files that left the file table
    dropped: list[FileRecord] = field(default_factory=list)
    #: ids of nodes that may have become leaves (new leaves, parents of removed nodes)
    leaves: list[int] = field(default_factory=list)
    #: ids of nodes that left the index (not those rewritten under the same id)
    removed: list[int] = field(default_factory=list)
    #: removed nodes whose rows now live in new nodes: ``(old id, new ids, k)``, the two
    #: halves of a split after ``k`` rows, or one node (a rewrite, ``k`` its length)
    successors: list[tuple[int, tuple[int, ...], int]] = field(default_factory=list)
    added_nodes: int = 0
    removed_nodes: int = 0


def apply_changes(tree: RadixTree, records: FileTable, changes: ChangeSet) -> Applied:
    """Bring ``tree`` and ``records`` to the state of ``changes`` (see the module)."""
    out = Applied()
    present_files = {rec.id: rec for rec in changes.files}
    for fid, rec in present_files.items():
        if fid not in records:
            records[fid] = rec
    rows = {row[0]: row for row in changes.nodes}
    pending: list[tuple[RadixNode | None, tuple]] = []  # (node to move, or None for a new one; its row)
    gone: list[RadixNode] = []
    removed: list[tuple[RadixNode, int]] = []  # (gone, no row under its id; its parent's id)
    new_ids: set[int] = set()
    for nid in sorted(changes.node_ids):
        node, row = tree.get(nid), rows.get(nid)
        if node is None:
            if row is not None:
                pending.append((None, row))
            continue
        if row is None or (node.file_id, node.file_row, node.length) != row[2:5]:
            gone.append(node)
            if row is not None:
                pending.append((None, row))
            else:
                out.removed.append(nid)
                removed.append((node, node.parent.id if node.parent is not None else -1))
            continue
        node.terminal = row[5]
        if node.parent is None or node.parent.id != row[1]:
            pending.append((node, row))
    moving = {id(node) for node, _ in pending if node is not None} | {id(node) for node in gone}
    for node in gone:
        parent = node.parent
        tree.detach(node, keep=False)
        out.removed_nodes += 1
        if parent is not None and parent.parent is not None:
            out.leaves.append(parent.id)
        for child in list(node.children.values()):  # (rows kept under the same id: they follow the new node)
            if id(child) not in moving:
                pending.append((child, (child.id, node.id)))
                moving.add(id(child))
    for node, _ in pending:
        if node is not None:
            parent = node.parent
            tree.detach(node)
            if parent is not None and parent.parent is not None:
                out.leaves.append(parent.id)
    while pending:
        waiting = []
        for node, row in pending:
            parent = tree.get(row[1])
            if parent is None:
                waiting.append((node, row))
                continue
            if node is None:
                rec = records.get(row[2])
                if rec is None or row[3] < 0 or row[4] <= 0 or row[3] + row[4] > rec.n_tokens:
                    raise ValueError(f"node {row[0]} points outside file {row[2]}")
                node = RadixNode(row[0], as_tokens(rec.tokens[row[3] : row[3] + row[4]]), row[2], row[3], parent, row[5])
                out.added_nodes += 1
                new_ids.add(node.id)
            tree.attach(parent, node)
            if not node.children:
                out.leaves.append(node.id)
        if len(waiting) == len(pending):
            raise ValueError(f"{len(waiting)} changed node(s) have no parent in the tree")
        pending = waiting
    for fid in changes.file_ids:
        if fid not in present_files:
            rec = records.pop(fid, None)
            if rec is not None:
                out.dropped.append(rec)
    out.successors = _successors(tree, removed, new_ids)
    leaves = dict.fromkeys(out.leaves)
    out.leaves = [i for i in leaves if (n := tree.get(i)) is not None and n.parent is not None and not n.children]
    return out


def _successors(
    tree: RadixTree, removed: list[tuple[RadixNode, int]], new_ids: set[int]
) -> list[tuple[int, tuple[int, ...], int]]:
    """Removed nodes whose tokens new nodes of the same change set now hold, in the
    same place of the tree: one node of the same length (a rewrite), or an upper half
    and its child (a split)."""
    out = []
    for node, parent_id in removed:
        parent = tree.get(parent_id)
        n = node.length
        head = parent.children.get(int(node.tokens[0])) if parent is not None and n else None
        k = head.length if head is not None else 0
        if head is None or head.id not in new_ids or k > n or not np.array_equal(head.tokens, node.tokens[:k]):
            continue
        if k == n:
            out.append((node.id, (head.id,), n))
            continue
        tail = head.children.get(int(node.tokens[k]))
        if tail is not None and tail.id in new_ids and np.array_equal(tail.tokens, node.tokens[k:]):
            out.append((node.id, (head.id, tail.id), k))
    return out
