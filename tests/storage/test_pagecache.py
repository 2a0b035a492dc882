"""`pagecache.cached_bytes` (Linux ``cachestat``): what it reports of a file just
written and of one dropped from the page cache, and that finding the system call starts
no process when the library is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from impress_cache.storage.pagecache import cached_bytes


def test_importing_the_library_starts_no_process():
    """``import impress_cache`` (which loads `pagecache`) runs no helper program (such
    as ``ldconfig``, which ``ctypes.util.find_library`` runs): what the process imported
    before it (torch, transformers) is imported first, then every process start is noted."""
    code = textwrap.dedent(
        """
        import platform, subprocess
        import torch, transformers
        platform.processor()
        started = []
        real = subprocess.Popen.__init__
        def noting(self, args, *a, **k):
            started.append(args)
            return real(self, args, *a, **k)
        subprocess.Popen.__init__ = noting
        import impress_cache
        print(started)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.strip() == "[]"


def test_a_file_just_written_is_cached_and_a_dropped_one_is_not(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * 4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        hot = cached_bytes(fd, 0, 64 * 4096)
        if hot is None:
            return  # a kernel without cachestat (or a sandbox that forbids it): cannot tell
        assert hot == 64 * 4096
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert cached_bytes(fd, 0, 64 * 4096) == 0
        assert cached_bytes(fd, 0, 0) == 0
    finally:
        os.close(fd)
