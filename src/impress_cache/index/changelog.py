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
    leaves = dict.fromkeys(out.leaves)
    out.leaves = [i for i in leaves if (n := tree.get(i)) is not None and n.parent is not None and not n.children]
    return out
