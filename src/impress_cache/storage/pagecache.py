"""How much of a file range is in the kernel's page cache (Linux ``cachestat``, 6.5+).

Exact reuse reads runs of blocks with ``O_DIRECT`` (`reader`), which skips the page
cache's copy and bookkeeping when the blocks are on the device only, but reads the
device even where the blocks are still cached (a file just written, or read through the
page cache before). With ``direct_io="auto"`` the reader asks first, with one
``cachestat`` system call per share of a layer's runs, and reads a mostly cached range
through the page cache instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

#: ``cachestat``'s number (the same in the generic and the x86-64 system call tables)
_NR_CACHESTAT = 451


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def _syscall():  # type: ignore[no-untyped-def]
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64", "riscv64"):
        return None
    try:  # the process's own symbols, libc's among them (``find_library`` would run ``ldconfig``)
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_call = _syscall()
#: ``False`` once the kernel said it has no ``cachestat`` (``ENOSYS``)
_available = _call is not None
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def cached_bytes(fd: int, offset: int, length: int) -> int | None:
    """Bytes of ``offset .. offset + length`` of the file ``fd`` that are in the page
    cache (whole pages), or ``None`` where the kernel cannot tell (no ``cachestat``)."""
    global _available
    if not _available or length <= 0:
        return None if not _available else 0
    rng, st = _Range(offset, length), _Stat()
    if _call(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) < 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a sandbox that forbids it
            _available = False
        return None
    return int(st.nr_cache) * PAGE
