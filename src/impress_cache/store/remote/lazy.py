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
name and present ranges), rewritten after each fill; a file whose every block has
arrived loses its sidecar and is an ordinary chunk file. Linked files and sidecars are
written like chunk files (`directory.write_file`: temporary name, fsync, rename, fsync
of the directory), and a fill's blocks are flushed before the sidecar lists them, so a
crash leaves a sidecar that lists only blocks on disk. A sidecar goes with its file
(`Catalog.unlink`, e.g. a disk eviction) and counts in the disk budget meanwhile.
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
from ...storage.base import ALIGN
from ...storage.remote import RemoteBackend, RemoteError
from ..directory import dir_mode, ensure_dir, write_file

log = logging.getLogger(__name__)

REMOTE_DIR = "remote"
#: seconds after which a temporary sidecar is a crash leftover (not another process's write)
STALE_TMP_S = 600.0
#: ranges (GETs) one fill issues at most; neighbours are merged, smallest gaps first
MAX_RANGES = 4


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
    def __init__(self, obj: str, size: int, data_start: int, present: list[tuple[int, int]]) -> None:
        self.object = obj
        self.size = size
        self.data_start = data_start
        self.present = _merge(present, gap=0)
        self.lock = threading.Lock()

    def missing(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        starts = np.array([a for a, _ in self.present], dtype=np.int64)
        out = []
        for a, b in ranges:
            i = int(np.searchsorted(starts, a, side="right")) - 1
            if i < 0 or self.present[i][1] < b:
                out.append((a, b))
        return out

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
        self._plain: set[str] = set()  # files known to have no sidecar
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

    def _load(self, local: str, drop_bad: bool = False) -> _Lazy | None:
        """The sidecar of ``local`` (written by this or another process sharing the
        directory), installed; ``None`` if it has none."""
        side = self._side(local)
        try:
            os.stat(local, dir_fd=self._chunks_fd)
            fd = os.open(side, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                d = json.loads(f.read())
            lz = _Lazy(d["object"], int(d["size"]), int(d["data_start"]), [tuple(r) for r in d["present"]])
        except (OSError, ValueError, KeyError, TypeError):
            if drop_bad:
                self._remove(side)  # its chunk file is gone, or the sidecar is damaged
            return None
        with self._lock:
            self._side_bytes[local] = max(st.st_size, st.st_blocks * 512)
            return self._files.setdefault(local, lz)

    def _get(self, local: str) -> _Lazy | None:
        with self._lock:
            lz = self._files.get(local)
            if lz is not None or local in self._plain:
                return lz
        # first sight of a file another process of this directory committed: its sidecar
        # (written before the commit) says whether it is linked; a file without one never
        # becomes linked, so the answer is remembered
        lz = self._load(local) if local.endswith(".safetensors") else None
        if lz is None:
            with self._lock:
                self._plain.add(local)
        return lz

    def linked(self, local: str) -> bool:
        """Whether blocks of a local file may still have to come from the remote."""
        return self._get(local) is not None

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
        lz = _Lazy(obj, size, len(header), [(0, len(header))])
        with self._lock:
            self._files[local] = lz
        self._save(local, lz)
        return True

    def drop(self, local: str) -> None:
        """Forget a file's sidecar and remove it (the file was removed, quarantined or
        completed)."""
        with self._lock:
            self._files.pop(local, None)
            self._side_bytes.pop(local, None)
        if local.endswith(".safetensors"):
            self._remove(self._side(local))

    def disk_bytes(self) -> int:
        """Bytes the sidecars this process knows take on disk."""
        with self._lock:
            return sum(self._side_bytes.values())

    def close(self) -> None:
        os.close(self._dir_fd)

    def _save(self, local: str, lz: _Lazy) -> None:
        if lz.complete():
            self.drop(local)
            return
        raw = json.dumps({"object": lz.object, "size": lz.size, "data_start": lz.data_start, "present": lz.present})
        nbytes = write_file(self._dir_fd, self._side(local), raw.encode(), self._mode, self._fsync)
        with self._lock:
            self._side_bytes[local] = nbytes or 0

    def fill(self, file_id: int, local: str, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Make the blocks at ``offsets`` (``sizes`` bytes each) of a local file present,
        fetching what is missing; raises `CorruptBlockError` if the remote cannot serve it."""
        lz = self._get(local)
        if lz is None:
            return
        want = [(int(a), int(a) + int(n)) for a, n in zip(offsets.tolist(), sizes.tolist())]
        with lz.lock:
            todo = _coalesce(lz.missing(want), MAX_RANGES)
            if not todo:
                return
            t0 = time.perf_counter()
            try:
                parts = self._backend.get_ranges(lz.object, todo)
            except RemoteError as exc:
                raise CorruptBlockError(f"blocks of {local} could not be fetched from the remote tier: {exc}", file_id) from exc
            try:
                fd = os.open(local, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._chunks_fd)
            except OSError as exc:  # removed meanwhile (e.g. evicted by another process)
                self.drop(local)
                raise CorruptBlockError(f"linked file {local} cannot be filled: {exc}", file_id) from exc
            try:
                for (a, _), data in zip(todo, parts):
                    view, pos = memoryview(data), a
                    while view:
                        n = os.pwrite(fd, view, pos)
                        view, pos = view[n:], pos + n
                if self._fsync:
                    os.fsync(fd)  # on disk before the sidecar says so
            finally:
                os.close(fd)
            lz.present = _merge(lz.present + todo, gap=0)
            self._save(local, lz)
            self._on_fetch(len(todo), sum(b - a for a, b in todo))
            log.debug("fetched %d ranges of %s in %.3f s", len(todo), local, time.perf_counter() - t0)
