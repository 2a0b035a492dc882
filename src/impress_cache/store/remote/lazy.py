"""Chunk files linked from the remote tier whose blocks arrive when a request reads them.

An imported object becomes a local chunk file of its full size holding only its header;
its blocks are holes. `RemoteFiles.fill` runs on the read path before blocks of such a
file are read from disk: it fetches the byte ranges of the blocks not yet here with
ranged GETs (neighbouring blocks merged into one range, all ranges of a call issued
concurrently), writes them into the file and records them as present. The local reader
then reads and verifies them like any other block: the CRC-32C seeded by the file's
identity catches a damaged or substituted range, and a failed fetch is reported as a
`CorruptBlockError`, so the request quarantines the file and recomputes.

Which ranges are present is kept in ``remote/<uuid>.json`` next to ``chunks/`` (object
name and present ranges). A fill marks its ranges present in memory at once (this
process reads them from the page cache); the sidecar is rewritten at most every
`SAVE_EVERY_S` seconds per file, when the file is complete, at `RemoteTier.flush` and at
close, after one fsync of the file's data: a crash leaves a sidecar that lists only
blocks on disk (ranges written since the last save are fetched again). A file whose
every block has arrived loses its sidecar and is an ordinary chunk file. Linked files
and sidecars are written like chunk files (`directory.write_file`: temporary name,
fsync, rename, fsync of the directory). A sidecar goes with its file (`Catalog.unlink`,
e.g. a disk eviction) and counts in the disk budget meanwhile.

What this process knows of a file (linked, and which ranges are present, or plain) is
tied to the file's inode (and, for a plain file, its change time): a file replaced under
its name (pulled again after a quarantine or an eviction, by this process or another one
of the directory) is looked at afresh, never read with another file's answer.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...errors import CorruptBlockError
from ...storage.remote import RemoteBackend, RemoteError
from ...storage.base import ALIGN, disk_bytes
from ..directory import dir_mode, ensure_dir, write_file

log = logging.getLogger(__name__)

REMOTE_DIR = "remote"
#: seconds after which a temporary sidecar is a crash leftover (not another process's write)
STALE_TMP_S = 600.0
#: ranges (GETs) one fill issues at most; neighbours are merged, smallest gaps first
MAX_RANGES = 4
#: seconds between two rewrites of one file's sidecar by fills (see the module's text)
SAVE_EVERY_S = 1.0


def _merge(ranges: list[tuple[int, int]], gap: int = ALIGN) -> list[tuple[int, int]]:
    """Sorted, merged ranges; ranges less than ``gap`` bytes apart (alignment padding) become one."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a < out[-1][1] + gap or (out and a <= out[-1][1]):
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _coalesce(ranges: list[tuple[int, int]], max_ranges: int) -> list[tuple[int, int]]:
    """At most ``max_ranges`` ranges covering ``ranges`` (merged ones): the smallest gaps
    are filled first. Each range is one GET, whose fixed cost (a round trip, signing and
    parsing the request) outweighs a few blocks of extra bytes."""
    out = [list(r) for r in _merge(ranges)]
    while len(out) > max_ranges:
        i = min(range(len(out) - 1), key=lambda j: out[j + 1][0] - out[j][1])
        out[i][1] = out[i + 1][1]
        del out[i + 1]
    return [(a, b) for a, b in out]


class _Lazy:
    """A linked file: its object, and which byte ranges of the file (inode ``ino``) are here."""

    def __init__(self, obj: str, size: int, data_start: int, present: list[tuple[int, int]], ino: int) -> None:
        self.object = obj
        self.size = size
        self.data_start = data_start
        self.ino = ino
        #: the index id of the file (never reused, unlike an inode number); ``None`` until
        #: a read names it (a file this process linked is not indexed yet)
        self.file_id: int | None = None
        self.lock = threading.Lock()
        #: present ranges the sidecar does not list yet, and when it was last written
        self.unsaved = False
        self.saved_at = time.monotonic()
        self._set(_merge(present, gap=0))

    def _set(self, present: list[tuple[int, int]]) -> None:
        self.present = present
        self._starts = np.array([a for a, _ in present], dtype=np.int64)
        self._ends = np.array([b for _, b in present], dtype=np.int64)

    def add(self, ranges: list[tuple[int, int]]) -> None:
        self._set(_merge(self.present + ranges, gap=0))

    def missing(self, starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
        """The ranges ``[starts[i], ends[i])`` not wholly inside one present range."""
        if not len(self._starts):
            return list(zip(starts.tolist(), ends.tolist()))
        i = np.searchsorted(self._starts, starts, side="right") - 1
        here = (i >= 0) & (self._ends[np.maximum(i, 0)] >= ends)
        return list(zip(starts[~here].tolist(), ends[~here].tolist()))

    def complete(self) -> bool:
        return len(self.present) == 1 and self.present[0] == (0, self.size)


class RemoteFiles:
    """The lazily filled chunk files of one store directory."""

    def __init__(
        self, root: Path, chunks_fd: int, backend: RemoteBackend, on_fetch: Callable[[int, int], None],
        file_mode: int = 0o600, fsync: bool = True,
    ) -> None:
        self.dir = root / REMOTE_DIR
        self._mode = file_mode
        self._fsync = fsync
        ensure_dir(self.dir, dir_mode(file_mode), "the remote tier's folder")
        self._dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._chunks_fd = chunks_fd
        self._backend = backend
        self._on_fetch = on_fetch  # (ranges, bytes) fetched
        self._files: dict[str, _Lazy] = {}
        #: files known to have no sidecar, with the (inode, change time) they had then
        self._plain: dict[str, tuple[int, int]] = {}
        self._side_bytes: dict[str, int] = {}  # sidecars on disk, by file: bytes they take
        self._lock = threading.Lock()
        now = time.time()
        for entry in os.scandir(self._dir_fd):
            if entry.name.endswith(".json"):
                self._load(entry.name[: -len(".json")] + ".safetensors", drop_bad=True)
            elif entry.name.endswith(".tmp") and now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                self._remove(entry.name)  # left by a crash during a sidecar's write

    @staticmethod
    def _side(local: str) -> str:
        return local.split(".")[0] + ".json"

    def _remove(self, side: str) -> None:
        try:
            os.unlink(side, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. closed meanwhile: the next open removes it (its file is gone)
            log.debug("could not remove the sidecar %s: %s", side, exc)

    def _stat(self, local: str) -> os.stat_result | None:
        try:
            return os.stat(local, dir_fd=self._chunks_fd, follow_symlinks=False)
        except OSError:
            return None

    def _load(self, local: str, drop_bad: bool = False, file_id: int | None = None) -> _Lazy | None:
        """The sidecar of ``local`` (written by this or another process sharing the
        directory), installed; ``None`` if it has none (remembered with the file's
        inode and change time)."""
        side = self._side(local)
        st = self._stat(local)
        try:
            if st is None:
                raise FileNotFoundError(local)
            fd = os.open(side, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
            with os.fdopen(fd, "rb") as f:
                side_st = os.fstat(f.fileno())
                d = json.loads(f.read())
            lz = _Lazy(
                d["object"], int(d["size"]), int(d["data_start"]), [tuple(r) for r in d["present"]], st.st_ino
            )
        except (OSError, ValueError, KeyError, TypeError):
            if drop_bad:
                self._remove(side)  # its chunk file is gone, or the sidecar is damaged
            with self._lock:
                old = self._files.get(local)
                if st is not None and (old is None or old.ino != st.st_ino):
                    self._files.pop(local, None)
                    self._plain[local] = (st.st_ino, st.st_ctime_ns)
            return None
        with self._lock:
            self._side_bytes[local] = disk_bytes(side_st)
            self._plain.pop(local, None)
            old = self._files.get(local)
            if old is not None and old.ino == lz.ino and _same_file(old, file_id):
                return old  # installed meanwhile by another thread: it may know more
            lz.file_id = file_id
            self._files[local] = lz
            return lz

    def _get(self, local: str, file_id: int | None = None) -> _Lazy | None:
        if not local.endswith(".safetensors"):
            return None  # only safetensors files are linked
        st = self._stat(local)
        if st is None:
            return None  # gone: its reader reports it
        with self._lock:
            lz = self._files.get(local)
            # the same inode number may be a new file (one evicted and linked again under
            # its name): the index id tells them apart
            if lz is not None and lz.ino == st.st_ino and _same_file(lz, file_id):
                if lz.file_id is None:
                    lz.file_id = file_id
                return lz
            if lz is None and self._plain.get(local) == (st.st_ino, st.st_ctime_ns):
                return None
        # first sight of this file (one another process of this directory committed, or
        # one that replaced the file this process knew under the name): its sidecar,
        # written before the commit, says whether it is linked
        return self._load(local, file_id=file_id)

    def linked(self, local: str, file_id: int | None = None) -> bool:
        """Whether blocks of a local file (index id ``file_id``) may still have to come
        from the remote."""
        return self._get(local, file_id) is not None

    def object_of(self, local: str) -> str | None:
        """The remote object a lazily filled local file stands for."""
        lz = self._get(local)
        return None if lz is None else lz.object

    def create(self, local: str, obj: str, size: int, header: bytes) -> bool:
        """Write a new local file of ``size`` bytes holding ``header`` (the rest are holes)
        and its sidecar. The file is an orphan (removed on open) until the index commits
        it. False when another process of this directory links (or has linked) it."""
        try:
            done = write_file(
                self._chunks_fd, local, header, self._mode, self._fsync, size=size, tmp=local + ".tmp", replace=False
            )
        except FileExistsError:
            return False  # its temporary file: another process is linking it now
        if done is None:
            return False
        st = self._stat(local)
        lz = _Lazy(obj, size, len(header), [(0, len(header))], st.st_ino if st is not None else -1)
        with self._lock:
            self._files[local] = lz
            self._plain.pop(local, None)
        with lz.lock:
            self._save(local, lz, None)
        return True

    def drop(self, local: str) -> None:
        """Forget a file's sidecar and remove it (the file was removed, quarantined or
        completed)."""
        with self._lock:
            self._files.pop(local, None)
            self._plain.pop(local, None)
            self._side_bytes.pop(local, None)
        if local.endswith(".safetensors"):
            self._remove(self._side(local))

    def disk_bytes(self) -> int:
        """Bytes the sidecars this process knows take on disk."""
        with self._lock:
            return sum(self._side_bytes.values())

    def save(self) -> None:
        """Write the sidecars of files filled since their last save (`RemoteTier.flush`, close)."""
        with self._lock:
            todo = [(local, lz) for local, lz in self._files.items() if lz.unsaved]
        for local, lz in todo:
            with lz.lock:
                if lz.unsaved:
                    self._save_quietly(local, lz, None)

    def close(self) -> None:
        self.save()
        os.close(self._dir_fd)

    def _save_quietly(self, local: str, lz: _Lazy, fd: int | None) -> None:
        try:
            self._save(local, lz, fd)
        except OSError as exc:  # the blocks are here: a later save lists them, or they are fetched again
            log.warning("could not save the sidecar of the linked file %s: %s", local, exc)

    def _save(self, local: str, lz: _Lazy, fd: int | None) -> None:
        """Write ``lz``'s sidecar (under ``lz.lock``), after flushing the file's data
        (``fd``: a descriptor of it, else it is opened): a sidecar lists only blocks on
        disk. A complete file loses its sidecar."""
        if lz.unsaved:
            own = fd is None
            if own:
                try:
                    fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._chunks_fd)
                except FileNotFoundError:
                    lz.unsaved = False  # removed meanwhile: nothing to save
                    return
            try:
                if os.fstat(fd).st_ino != lz.ino:
                    lz.unsaved = False  # replaced under its name: its own sidecar describes it
                    return
                if self._fsync:
                    os.fsync(fd)  # on disk before the sidecar says so
            finally:
                if own:
                    os.close(fd)
        lz.unsaved, lz.saved_at = False, time.monotonic()
        if lz.complete():
            self.drop(local)
            return
        raw = json.dumps({"object": lz.object, "size": lz.size, "data_start": lz.data_start, "present": lz.present})
        nbytes = write_file(self._dir_fd, self._side(local), raw.encode(), self._mode, self._fsync)
        with self._lock:
            self._side_bytes[local] = nbytes or 0

    def fill(self, file_id: int, local: str, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Make the blocks at ``offsets`` (``sizes`` bytes each) of a local file present,
        fetching what is missing; raises `CorruptBlockError` if the remote cannot serve it
        or the local file cannot take it."""
        starts = np.asarray(offsets, dtype=np.int64)
        ends = starts + np.asarray(sizes, dtype=np.int64)
        for _ in range(2):  # again once if the file was replaced under its name meanwhile
            lz = self._get(local, file_id)
            if lz is None or self._fill(file_id, local, lz, starts, ends):
                return
        raise CorruptBlockError(f"linked file {local} was replaced while it was filled", file_id)

    def _completed_elsewhere(self, local: str, lz: _Lazy, starts: np.ndarray, ends: np.ndarray) -> bool:
        """After a failed fetch: whether another process of this directory made the ranges
        present meanwhile (its sidecar lists them now, or it completed the file and removed
        the sidecar). Whatever is read is still checked block by block."""
        st = self._stat(local)
        if st is None or st.st_ino != lz.ino:
            return False
        try:
            fd = os.open(self._side(local), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:  # completed: the process that fetched the last range removed it
            with self._lock:
                if self._files.get(local) is lz:
                    del self._files[local]
                self._plain[local] = (st.st_ino, st.st_ctime_ns)
            return True
        except OSError:
            return False
        try:
            with os.fdopen(fd, "rb") as f:
                lz.add([(int(a), int(b)) for a, b in json.loads(f.read())["present"]])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return not lz.missing(starts, ends)

    def _fill(self, file_id: int, local: str, lz: _Lazy, starts: np.ndarray, ends: np.ndarray) -> bool:
        """One `fill` of the file ``lz`` describes; False if the name holds another file now."""
        with lz.lock:
            todo = _coalesce(lz.missing(starts, ends), MAX_RANGES)
            if not todo:
                return True
            t0 = time.perf_counter()
            try:
                parts = self._backend.get_ranges(lz.object, todo)
            except RemoteError as exc:
                if self._completed_elsewhere(local, lz, starts, ends):
                    return True
                raise CorruptBlockError(f"blocks of {local} could not be fetched from the remote tier: {exc}", file_id) from exc
            try:
                fd = os.open(local, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._chunks_fd)
            except OSError as exc:  # removed meanwhile (e.g. evicted by another process)
                self.drop(local)
                raise CorruptBlockError(f"linked file {local} cannot be filled: {exc}", file_id) from exc
            try:
                if os.fstat(fd).st_ino != lz.ino:
                    with self._lock:
                        if self._files.get(local) is lz:
                            del self._files[local]
                    return False
                try:
                    for (a, _), data in zip(todo, parts):
                        view, pos = memoryview(data), a
                        while view:
                            n = os.pwrite(fd, view, pos)
                            view, pos = view[n:], pos + n
                except OSError as exc:  # no space, a file size limit: nothing of this fill is marked
                    raise CorruptBlockError(f"linked file {local} cannot be filled: {exc}", file_id) from exc
                lz.add(todo)  # this process reads them now (page cache); the sidecar waits
                lz.unsaved = True
                if lz.complete() or time.monotonic() - lz.saved_at >= SAVE_EVERY_S:
                    self._save_quietly(local, lz, fd)
            finally:
                os.close(fd)
            self._on_fetch(len(todo), sum(b - a for a, b in todo))
            log.debug("fetched %d ranges of %s in %.3f s", len(todo), local, time.perf_counter() - t0)
            return True


def _same_file(lz: _Lazy, file_id: int | None) -> bool:
    """Whether what this process knows (``lz``) may be about the indexed file ``file_id``."""
    return file_id is None or lz.file_id is None or lz.file_id == file_id

