"""Placed reads with ``O_DIRECT`` (`reader._read_placed`, `reader._read_direct`): aligned
runs read past the page cache, unaligned runs and refusals read through it (counted),
a short last block at the end of the file, damage caught before any row is placed."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from impress_cache import CorruptBlockError
from impress_cache.storage.pagecache import cached_bytes
from impress_cache.storage.reader import BlockReader, DirectCounts
from impress_cache.tools import drop_file
from test_placed import HEADS, ROW, _file, _group

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")


def _cold(path):
    """Write the file's pages to the device and drop them from the page cache."""
    drop_file(path)


def _read(path, blocks, offsets, out, inline=False, corrupt=None):
    """Read a group with a buffered and an ``O_DIRECT`` descriptor; returns the counts."""
    fd = os.open(path, os.O_RDONLY)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    counts = DirectCounts()
    reader = BlockReader(threads=4)
    try:
        g = _group(path, blocks, offsets, out, corrupt=corrupt)
        g.fd, g.direct_fd, g.counts = fd, dfd, counts
        reader.submit([g], memoryview(b""), inline=inline).wait()
    finally:
        reader.close()
        os.close(fd)
        os.close(dfd)
    return counts


def _runs(offsets, blocks):
    """How many runs the reader cuts a group into (a fresh reader's `_runs`)."""
    reader = BlockReader(threads=1)
    try:
        g = _group(None, blocks, offsets, np.zeros((2, HEADS, sum(b.shape[2] for b in blocks), ROW), np.uint8))
        return len(reader._runs(g, 512 * 2**10))
    finally:
        reader.close()


@pytest.mark.parametrize("inline", [False, True])
def test_aligned_runs_are_read_past_the_page_cache(tmp_path, inline):
    """4 KiB-aligned blocks and a short last block that ends the file inside a page:
    every run is read with ``O_DIRECT`` (the last one stops at the end of the file), the
    rows are the stored ones, and the file's pages stay out of the page cache."""
    rows_per_block = [16] * 70 + [5]
    path, blocks, offsets = _file(tmp_path, rows_per_block, True)
    assert os.path.getsize(path) % 4096  # the file ends inside a page
    _cold(path)
    out = np.full((2, HEADS, sum(rows_per_block), ROW), 0xAB, dtype=np.uint8)
    counts = _read(path, blocks, offsets, out, inline)
    assert np.array_equal(out, np.concatenate(blocks, axis=2))
    assert (counts.direct, counts.buffered, counts.refused) == (_runs(offsets, blocks), 0, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        cached = cached_bytes(fd, 0, os.path.getsize(path))
    finally:
        os.close(fd)
    assert cached in (None, 0)  # (None: a kernel without cachestat cannot tell)


def test_unaligned_runs_are_read_through_the_page_cache(tmp_path):
    """Blocks of 22.5 KiB without padding: a run that starts inside a page is read
    through the page cache, the others with ``O_DIRECT``; every row is right."""
    rows_per_block = [15] * 70 + [5]
    path, blocks, offsets = _file(tmp_path, rows_per_block, False)
    _cold(path)
    out = np.full((2, HEADS, sum(rows_per_block), ROW), 0xAB, dtype=np.uint8)
    counts = _read(path, blocks, offsets, out)
    assert np.array_equal(out, np.concatenate(blocks, axis=2))
    assert counts.direct >= 1 and counts.buffered >= 1 and counts.refused == 0
    assert counts.direct + counts.buffered == _runs(offsets, blocks)


@pytest.mark.parametrize("flushed", [True, False])
def test_a_damaged_byte_on_disk_is_caught_before_its_block_is_placed(tmp_path, flushed):
    """A byte changed in the file (written to the device and dropped from the page
    cache, or still a dirty page: ``O_DIRECT`` reads what the file holds either way)
    fails its block's checksum; none of that block's rows reach the destination."""
    path, blocks, offsets = _file(tmp_path, [16] * 60, True)
    bad = 45
    with open(path, "r+b") as f:
        f.seek(int(offsets[bad]) + 300)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    if flushed:
        _cold(path)
    out = np.full((2, HEADS, 16 * 60, ROW), 0xAB, dtype=np.uint8)
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        _read(path, blocks, offsets, out)
    assert (out[:, :, bad * 16 : (bad + 1) * 16] == 0xAB).all()


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_refused_read_falls_back_to_the_page_cache(tmp_path, monkeypatch, refusal):
    """A file system that opens with ``O_DIRECT`` but refuses the reads (``EINVAL``, or
    ``EOPNOTSUPP`` as some stacked and FUSE file systems say it; no such file system is
    mounted here, so the refusal is injected for the ``O_DIRECT`` descriptor only): every
    run is read through the page cache and counted as refused, the file not taken for
    damaged."""
    path, blocks, offsets = _file(tmp_path, [16] * 70 + [5], True)
    real = os.preadv
    direct_fds: set[int] = set()

    def refusing(fd, buffers, offset, *flags):
        if fd in direct_fds:
            raise OSError(refusal, os.strerror(refusal))
        return real(fd, buffers, offset, *flags)

    real_open = os.open

    def noting(p, flags, *args, **kwargs):
        fd = real_open(p, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    monkeypatch.setattr(os, "preadv", refusing)
    monkeypatch.setattr(os, "open", noting)
    out = np.full((2, HEADS, 16 * 70 + 5, ROW), 0xAB, dtype=np.uint8)
    counts = _read(path, blocks, offsets, out)
    assert np.array_equal(out, np.concatenate(blocks, axis=2))
    assert (counts.direct, counts.buffered, counts.refused) == (0, 0, _runs(offsets, blocks))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_does_not_share_the_staging_buffer():
    """The staging buffer a thread had when the process forked stays the parent's: a
    child reading into its copy (the thread that forked goes on in the child) changes
    nothing the parent verified and is about to place."""
    from impress_cache.storage.placed import stage_buffer

    stage = stage_buffer(8192)
    stage[:] = b"\x11" * 8192
    pid = os.fork()
    if pid == 0:  # the child: write over its staging buffer, then leave at once
        try:
            stage_buffer(8192)[:] = b"\xee" * 8192
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(stage) == b"\x11" * 8192


@pytest.mark.parametrize("cut", [0, 4096, 1000])
def test_a_file_truncated_inside_a_run_is_reported_not_placed(tmp_path, cut):
    """The file ends inside a run (at a block's start, at a page inside it, or inside a
    page): the ``O_DIRECT`` read stops there, the rest read through the page cache finds
    the end of the file, and the read fails as truncated with none of that block's rows
    placed."""
    path, blocks, offsets = _file(tmp_path, [16] * 60, True)
    bad = 45
    _cold(path)
    os.truncate(path, int(offsets[bad]) + cut)
    out = np.full((2, HEADS, 16 * 60, ROW), 0xAB, dtype=np.uint8)
    with pytest.raises(CorruptBlockError, match="truncated"):
        _read(path, blocks, offsets, out)
    assert (out[:, :, bad * 16 :] == 0xAB).all()
