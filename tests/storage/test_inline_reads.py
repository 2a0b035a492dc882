"""Inline reads (`BlockReader.submit(..., inline=True)`: a sparse layer's chosen blocks,
read in the request's thread) ask the kernel for all their runs first."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from impress_cache.storage.base import checksum
from impress_cache.storage.pagecache import cached_bytes
from impress_cache.storage.reader import BlockReader, FileBlocks, _ask_ahead

BLOCK = 8192  # two pages


def _cold_file(path, blocks: int) -> np.ndarray:
    data = np.random.default_rng(blocks).integers(0, 256, blocks * BLOCK, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return data


def _group(fd, path, data, chosen, file_id=0):
    chosen = np.asarray(chosen, dtype=np.int64)
    offsets = chosen * BLOCK
    seeds = (chosen * 31).astype(np.uint32)
    sums = np.array([checksum(data[o : o + BLOCK].tobytes(), int(s)) for o, s in zip(offsets, seeds)], dtype=np.uint32)
    return FileBlocks(file_id, path, fd, offsets, np.full(len(chosen), BLOCK), sums, seeds, np.arange(len(chosen)) * BLOCK)


def _cached(fd, block: int, count: int = 1) -> int:
    got = cached_bytes(fd, block * BLOCK, count * BLOCK)
    assert got is not None
    return got


def test_an_inline_read_asks_for_every_run_first_and_nothing_between_them(tmp_path):
    path = tmp_path / "chunk.bin"
    data = _cold_file(path, 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the store opens its chunk files
        if cached_bytes(fd, 0, 64 * BLOCK) is None:
            pytest.skip("the kernel cannot tell what is in the page cache (no cachestat)")
        if _cached(fd, 0, 64):
            pytest.skip("this file system keeps the file in memory (tmpfs): nothing to ask the device for")
        chosen = [[2, 3, 4], [20], [40, 41], [60]]  # four runs, gaps of whole blocks between them
        group = _group(fd, path, data, [b for run in chosen for b in run])
        reader = BlockReader(threads=2)
        try:
            runs = _ask_ahead([group], reader._runs)
            assert [[int(group.offsets[i]) // BLOCK for i in idx] for idx in runs[0]] == chosen
            deadline = time.monotonic() + 5
            while _cached(fd, 60) < BLOCK and time.monotonic() < deadline:  # the hint is asynchronous
                time.sleep(0.01)
            for run in chosen:
                assert _cached(fd, run[0], len(run)) == len(run) * BLOCK
            for gap in (0, 1, 5, 10, 19, 21, 30, 42, 59, 61, 63):
                assert _cached(fd, gap) == 0, gap
            # and the inline read gives the chosen blocks, verified
            out = np.zeros(sum(map(len, chosen)) * BLOCK, dtype=np.uint8)
            group = _group(fd, path, data, [b for run in chosen for b in run])
            reader.submit([group], memoryview(out), inline=True).wait()
            want = np.concatenate([data[b * BLOCK : (b + 1) * BLOCK] for run in chosen for b in run])
            assert np.array_equal(out, want)
        finally:
            reader.close()
    finally:
        os.close(fd)


def test_an_inline_read_of_a_damaged_block_raises_after_reading_the_rest(tmp_path):
    from impress_cache import CorruptBlockError

    path = tmp_path / "chunk.bin"
    data = _cold_file(path, 16)
    fd = os.open(path, os.O_RDONLY)
    try:
        good = _group(fd, path, data, [1, 2, 9])
        bad = _group(fd, path, data, [5, 12], file_id=7)
        bad.expected[1] ^= 1
        out = np.zeros(5 * BLOCK, dtype=np.uint8)
        bad.dest += 3 * BLOCK
        reader = BlockReader(threads=2)
        try:
            with pytest.raises(CorruptBlockError) as err:
                reader.submit([bad, good], memoryview(out), inline=True).wait()
            assert err.value.file_id == 7
            assert np.array_equal(out[: 3 * BLOCK], np.concatenate([data[b * BLOCK : (b + 1) * BLOCK] for b in (1, 2, 9)]))
        finally:
            reader.close()
    finally:
        os.close(fd)


def test_an_inline_read_hands_groups_that_fetch_first_to_the_reader_threads(tmp_path):
    """A group whose blocks must be fetched first (a remote tier's linked file) is read on
    a reader thread, started before the local groups are read here: remote fetches of
    several files overlap each other and the local reads."""
    import threading

    data = {}
    groups = []
    for i in range(3):
        path = tmp_path / f"chunk{i}.bin"
        data[i] = _cold_file(path, 8)
        groups.append(_group(None, path, data[i], [1, 4, 5], file_id=i))
    fetched_on: list[str] = []

    def fetch() -> None:
        fetched_on.append(threading.current_thread().name)

    for g in groups[1:]:
        g.before = fetch
    for k, g in enumerate(groups):
        g.dest = g.dest + k * 3 * BLOCK
    out = np.zeros(9 * BLOCK, dtype=np.uint8)
    reader = BlockReader(threads=2)
    try:
        reader.submit(groups, memoryview(out), inline=True).wait()
    finally:
        reader.close()
    assert len(fetched_on) == 2 and threading.current_thread().name not in fetched_on
    for k in range(3):
        want = np.concatenate([data[k][b * BLOCK : (b + 1) * BLOCK] for b in (1, 4, 5)])
        assert np.array_equal(out[k * 3 * BLOCK : (k + 1) * 3 * BLOCK], want)


class _InterruptingPath(type(Path())):
    """A path whose opening is interrupted (Ctrl-C while the request's thread reads)."""

    def __fspath__(self) -> str:
        raise KeyboardInterrupt


def test_an_interrupt_in_an_inline_read_ends_every_groups_loan_once(tmp_path):
    """An interrupt inside a group read in the request's thread (here: opening a file
    past the descriptor cap) reaches the caller; every group's ``done`` is called exactly
    once: the fetched group's by its reader thread (given last, started first: the groups
    are sorted), the interrupted one's, and the one after it, never started."""
    import threading

    paths = [tmp_path / f"chunk{i}.bin" for i in range(3)]
    data = [_cold_file(p, 8) for p in paths]
    ended: list[str] = []
    lock = threading.Lock()

    def done(name):
        def call():
            with lock:
                ended.append(name)
        return call

    fd = os.open(paths[0], os.O_RDONLY)
    try:
        unstarted = _group(fd, paths[0], data[0], [1, 2])
        interrupted = _group(None, _InterruptingPath(paths[1]), data[1], [3])
        fetched = _group(None, paths[2], data[2], [4], file_id=2)
        fetched.before = lambda: None
        for name, g in (("unstarted", unstarted), ("interrupted", interrupted), ("fetched", fetched)):
            g.done = done(name)
        out = np.zeros(2 * BLOCK, dtype=np.uint8)
        reader = BlockReader(threads=2)
        try:
            with pytest.raises(KeyboardInterrupt):
                reader.submit([interrupted, unstarted, fetched], memoryview(out), inline=True)
        finally:
            reader.close()  # (the fetched group's read ends)
        assert sorted(ended) == ["fetched", "interrupted", "unstarted"]
    finally:
        os.close(fd)
