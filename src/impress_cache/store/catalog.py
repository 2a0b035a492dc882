"""The store's metadata room: the radix tree, the SQLite index and the open-file table.

Everything here runs under one lock (`Catalog.lock`), which the rest of the store takes
only for a few index operations at a time. The tree in memory mirrors the index; when
another process commits to the index, `refresh` reloads the tree and forgets what this
process knew about files that changed (``on_forget`` lets the memory tiers drop their
blocks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptBlockError
from ..index.radix import Match, RadixNode, RadixTree
from ..index.sqlite import FileRecord, Index
from ..storage.base import BlockInfo, BlockKey

CHUNK_DIR = "chunks"


@dataclass
class OpenFile:
    """A chunk file this process has looked up: its record, path and block table."""

    record: FileRecord
    path: Path
    blocks: dict[tuple[int, int, int], BlockInfo]  # (kind, layer, block)

    def info(self, key: BlockKey) -> BlockInfo:
        info = self.blocks.get(key[1:])
        if info is None:
            raise CorruptBlockError(f"block {key[1]}/{key[2]}/{key[3]} of file {self.path} is not indexed", key[0])
        return info


class Catalog:
    """Radix tree + index + file table of one store directory."""

    def __init__(self, root: Path, index: Index, on_forget: Callable[[set[int]], None]) -> None:
        self.root = root
        self.chunks = root / CHUNK_DIR
        self.index = index
        self.lock = threading.RLock()
        self._on_forget = on_forget
        self._files: dict[int, OpenFile] = {}
        #: name of every file whose blocks this process may hold in memory (detects reused ids)
        self._known: dict[int, str] = {}
        self.tree: RadixTree = index.load_tree()

    # -- tree ------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        with self.lock:
            self.refresh()
            return self.tree.match(tokens, limit)

    def node(self, node_id: int) -> RadixNode | None:
        with self.lock:
            try:
                return self.tree.node(node_id)
            except KeyError:
                return None

    def refresh(self) -> None:
        """Reload the tree if another process changed the index."""
        with self.lock:
            if self.index.changed_elsewhere():
                self.reload_tree()
                self._files.clear()
                current = {f.id: f.name for f in self.index.files()}
                stale = {fid for fid, name in self._known.items() if current.get(fid) != name}
                self.forget(stale)

    def reload_tree(self) -> None:
        """Rebuild the tree from the index, keeping the references of nodes still there."""
        with self.lock:
            locks = {n.id: n.lock_ref for n in self.tree.nodes() if n.lock_ref}
            self.tree = self.index.load_tree()
            for node_id, ref in locks.items():
                try:
                    self.tree.node(node_id).lock_ref = ref
                except KeyError:
                    pass

    def insert(self, conn: Any, tokens: Sequence[int], file_id: int, file_row_of_first_new: int = 0) -> RadixNode | None:
        """Insert ``tokens`` in the tree and persist the nodes that changed; return the
        new leaf (``None`` when every token was stored already)."""
        _, upper, leaf = self.tree.insert(tokens, file_id, file_row_of_first_new)
        if upper is not None:
            self.index.put_node(conn, upper)
            for child in upper.children.values():
                self.index.put_node(conn, child)
        if leaf is not None:
            self.index.put_node(conn, leaf)
        else:
            end = self.tree.match(tokens).segments
            if end:
                self.index.put_node(conn, end[-1].node)
        return leaf

    def remove(self, conn: Any, node: RadixNode) -> None:
        """Remove a leaf from the tree and the index."""
        self.tree.remove(node)
        self.index.delete_node(conn, node.id)

    # -- files -----------------------------------------------------------------------
    def open_file(self, file_id: int) -> OpenFile:
        with self.lock:
            f = self._files.get(file_id)
            if f is None:
                record = self.index.file(file_id)
                if record is None:
                    raise CorruptBlockError(f"file {file_id} is not in the index", file_id)
                f = OpenFile(record, self.chunks / record.name, self.index.blocks(file_id))
                self._files[file_id] = f
                known = self._known.get(file_id)
                if known is not None and known != record.name:
                    # the id was reused for a new file: blocks cached for the old one are stale
                    self.forget({file_id})
                    self._files[file_id] = f
                self._known[file_id] = record.name
            return f

    def chunk_tokens_of(self, file_id: int) -> int:
        return self.open_file(file_id).record.chunk_tokens

    def forget(self, file_ids: Iterable[int]) -> None:
        """Drop everything this process knows about files (deleted or replaced)."""
        ids = set(file_ids)
        if not ids:
            return
        with self.lock:
            for fid in ids:
                self._known.pop(fid, None)
                self._files.pop(fid, None)
            self._on_forget(ids)

    def drop_unreferenced_files(self, conn: Any) -> list[FileRecord]:
        """Delete from the index the files no node references; return their records.

        The caller unlinks them once the transaction has committed (or, for a
        quarantined file, moves it aside).
        """
        dropped = []
        for fid in self.index.unreferenced_files(conn):
            rec = self.index.file(fid)
            self.index.delete_file(conn, fid)
            if rec is not None:
                dropped.append(rec)
        return dropped
