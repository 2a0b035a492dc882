"""The store directory: created with the store's permissions, checked before anything in
it is opened, and refused when it is not the store's own.

The store touches only what it created. The path given to `ImpressStore` may itself be a
symbolic link (a mount point, say), but nothing the store keeps inside it may be one:
``chunks/``, ``quarantine/`` and the index must be a real directory or regular file, or
absent. Directories are created with ``dir_mode(config.file_mode)`` (``0o700`` by
default) and files with ``config.file_mode`` (``0o600``), whatever the umask.

A path the process cannot write (a read-only volume or directory) raises
`ReadOnlyStoreError` saying how to open it read-only; a path that is a file, or a store
whose parts are links or of the wrong kind, raises `StoreFormatError`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ReadOnlyStoreError, StoreFormatError, StoreIOError
from ..storage.base import create_file, disk_bytes, kind_of

#: errors that mean "this path cannot be written"
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def dir_mode(file_mode: int) -> int:
    """A directory's bits for files of ``file_mode``: search wherever reading is allowed."""
    return file_mode | ((file_mode & 0o444) >> 2)


def read_only_error(path: Path, what: str) -> ReadOnlyStoreError:
    return ReadOnlyStoreError(
        f"cannot write the store at {path} ({what}). A store on a read-only path can still serve: open it "
        "with ImpressStore(path, model, config, read_only=True)"
    )


def ensure_dir(path: Path, mode: int, what: str) -> None:
    """Create ``path`` (one level) with ``mode`` unless it is a real directory already."""
    kind = kind_of(path)
    if kind == "dir":
        return
    if kind is not None:
        described = {"link": "a symbolic link", "file": "a file", "other": "not a directory"}[kind]
        raise StoreFormatError(
            f"{path} ({what}) is {described}; impress_cache only uses folders it created itself. "
            "Remove it or choose another store directory."
        )
    try:
        os.mkdir(path, mode)
        os.chmod(path, mode)  # mkdir's mode is masked by the umask
    except FileExistsError:
        if kind_of(path) != "dir":  # another process created something else meanwhile
            raise StoreFormatError(f"{path} ({what}) appeared while the store was created, and is not a directory")
    except OSError as exc:
        if exc.errno in _READ_ONLY:
            raise read_only_error(path, str(exc)) from exc
        raise StoreIOError(f"cannot create {path} ({what}): {exc}") from exc


def prepare(path: Path, chunk_dir: str, index_name: str, file_mode: int, read_only: bool) -> None:
    """Check (and unless ``read_only`` create) the store directory at ``path``."""
    mode = dir_mode(file_mode)
    if path.exists() and not path.is_dir():
        raise StoreFormatError(f"{path} is a file, not a store directory; pass the path of a directory")
    if read_only:
        if not path.is_dir() or not (path / index_name).exists():
            raise StoreFormatError(f"{path} holds no impress_cache store (no {index_name}); a read-only store cannot be created")
        for name in (chunk_dir, index_name):
            want = "dir" if name == chunk_dir else "file"
            if kind_of(path / name) != want:
                raise StoreFormatError(f"{path / name} is not the {'folder' if want == 'dir' else 'file'} this store keeps there")
        return
    if not path.exists():
        parent = path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno in _READ_ONLY:
                raise read_only_error(path, str(exc)) from exc
            raise StoreIOError(f"cannot create {parent}: {exc}") from exc
        ensure_dir(path, mode, "the store directory")
    if not os.access(path, os.W_OK) or (
        (path / index_name).exists() and not os.access(path / index_name, os.W_OK)
    ):
        raise read_only_error(path, "no write permission, or a read-only file system")
    ensure_dir(path / chunk_dir, mode, "the chunk files' folder")


# -- durable files (new ones made by `storage.base.create_file`, re-exported here) ------------
def publish(dir_fd: int, tmp: str, name: str, fsync: bool, replace: bool = True) -> bool:
    """Give the written (and, with ``fsync``, flushed) file ``tmp`` its final ``name`` in
    the directory ``dir_fd``, then flush the directory so the name survives a crash.
    ``replace=False`` never replaces an existing ``name``: ``tmp`` is removed and the
    result is False."""
    if replace:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    else:
        try:
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            os.unlink(tmp, dir_fd=dir_fd)
            return False
        os.unlink(tmp, dir_fd=dir_fd)
    if fsync:
        os.fsync(dir_fd)
    return True


def write_file(
    dir_fd: int, name: str, data: bytes, mode: int, fsync: bool, *, size: int | None = None,
    tmp: str | None = None, replace: bool = True,
) -> int | None:
    """Write ``data`` to the file ``name`` in ``dir_fd`` so that a crash leaves the old
    file or the new one, never a torn one: a temporary file (``tmp``, by default a
    unique name), ``fsync``, `publish`. ``size`` extends the file with a hole. Returns
    the bytes the file takes on disk, or ``None`` when ``replace=False`` found ``name``
    taken. Raises `FileExistsError` when ``tmp`` exists (another writer is at work)."""
    tmp = tmp if tmp is not None else f"{name}.{uuid.uuid4().hex}.tmp"
    fd = create_file(dir_fd, tmp, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if size is not None:
                os.ftruncate(fd, size)
            if fsync:
                os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not publish(dir_fd, tmp, name, fsync, replace):
            return None
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    return disk_bytes(st)


# -- files being created ------------------------------------------------------------------
#: the lock file (in the store directory) of `CreationGate`
GATE_NAME = "writers.lock"


class CreationGate:
    """Keeps the crash-leftover scan away from chunk files that are being written.

    A file in ``chunks/`` that the index does not list is a crash leftover only if no
    writer is still working on it: between its creation (as ``.tmp``) and the index
    commit that lists it, a file of a live writer looks just like one. Every writer, in
    any process, holds a shared ``flock`` on `GATE_NAME` from before it creates a file
    until it has committed it or removed it (`creating`); the scan runs only with the
    exclusive lock, taken without waiting (`exclusive`), so it sees each file either not
    yet created or already committed (or removed). A writer that dies loses its lock
    with its process. One shared lock per process (a count of the threads inside): the
    scan's own descriptor conflicts with it, so this process's writers hold it off too.
    """

    def __init__(self, root: Path, mode: int, read_only: bool = False) -> None:
        self._path, self._mode, self._read_only = root / GATE_NAME, mode, read_only
        self._mu = threading.Lock()
        self._fd: int | None = None
        self._inside = 0

    def _open(self) -> int:
        try:
            return os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        dir_fd = os.open(self._path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return create_file(dir_fd, self._path.name, self._mode)
        except FileExistsError:  # created by another process meanwhile
            return os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        finally:
            os.close(dir_fd)

    @contextmanager
    def creating(self) -> Iterator[None]:
        """Hold the shared lock (waiting while a scan runs) around creating and committing files."""
        if self._read_only:
            yield
            return
        with self._mu:
            if self._inside == 0:
                if self._fd is None:
                    self._fd = self._open()
                fcntl.flock(self._fd, fcntl.LOCK_SH)
            self._inside += 1
        try:
            yield
        finally:
            with self._mu:
                self._inside -= 1
                if self._inside == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextmanager
    def exclusive(self) -> Iterator[bool]:
        """The exclusive lock if nobody is creating a file now (yields True), else yields
        False at once."""
        fd = self._open()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                # explicitly: a process forked meanwhile shares the descriptor, and closing
                # ours alone would leave the lock held as long as the child lives
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._mu:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
