"""Removals from the radix tree and the file table, planned inside an index transaction
and applied to the in-memory tree only after that transaction has committed.

Quarantine, the disk budget (on its own or inside a write's transaction) and a node's
rewrite delete rows of the index. Each collects what it deleted in a `TreeChanges`:
the deletions run as SQL statements inside the transaction, while the tree and the file
table that requests match against stay as they are. The plan reads the tree through the
changes (`TreeChanges.is_leaf`: a node whose children were all deleted in this
transaction is a leaf now), so a batch of removals can take a leaf, then its parent.
Once ``COMMIT`` has returned, the tree and the file table follow the change log the
transaction read before it (`Catalog.transaction`); if the transaction rolls back, the changes are dropped and the tree,
never touched, still equals the index. No other thread ever sees a removal that may
still roll back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..index.files import FileRecord
from ..index.radix import RadixNode

if TYPE_CHECKING:
    from .catalog import Catalog


class TreeChanges:
    """Nodes and file rows one index transaction deletes (see the module docstring)."""

    def __init__(self) -> None:
        #: the deleted nodes, children before their parents (each a leaf once those
        #: before it are gone)
        self.removed: list[RadixNode] = []
        #: ids of the deleted nodes
        self.gone: set[int] = set()
        #: records of the deleted file rows
        self.dropped: list[FileRecord] = []

    def __bool__(self) -> bool:
        return bool(self.removed or self.dropped)

    def is_leaf(self, node: RadixNode) -> bool:
        """Whether ``node`` has no children once this transaction's deletions commit."""
        return all(child.id in self.gone for child in node.children.values())

    def remove_leaf(self, catalog: Catalog, conn: Any, node: RadixNode) -> RadixNode | None:
        """Delete the leaf ``node`` from the index (inside ``conn``'s transaction). Returns
        its parent when that has become a leaf (the root excepted)."""
        catalog.index.delete_node(conn, node.id)
        self.removed.append(node)
        self.gone.add(node.id)
        parent = node.parent
        if parent is not None and parent.parent is not None and parent.id not in self.gone and self.is_leaf(parent):
            return parent
        return None

    def drop_file_if_unreferenced(self, catalog: Catalog, conn: Any, file_id: int) -> FileRecord | None:
        """Delete ``file_id``'s row if no node references it any more (an indexed lookup,
        not a scan); returns its record, or ``None`` if it stays. The caller unlinks the
        file once the transaction has committed."""
        # a file another process added is read before its row goes; a loaded one only if it
        # is dropped (most leaves share their file with another node)
        rec = None if file_id in catalog.records else catalog.index.file(file_id)
        if not catalog.index.delete_file_if_unreferenced(conn, file_id):
            return None
        rec = catalog.records.get(file_id) or rec
        if rec is not None:
            self.dropped.append(rec)
        return rec

    def drop_unreferenced_files(self, catalog: Catalog, conn: Any) -> list[FileRecord]:
        """Delete every file row no node references; returns their records (the caller
        unlinks the files, or moves a quarantined one aside, once committed)."""
        out = []
        for fid in catalog.index.unreferenced_files(conn):
            rec = catalog.records.get(fid) or catalog.index.file(fid)
            catalog.index.delete_file(conn, fid)
            if rec is not None:
                out.append(rec)
        self.dropped.extend(out)
        return out
