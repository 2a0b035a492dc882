"""The reader's placed rows (`storage.placed`): runs longer than a staging buffer, two
shares, a short last block, gaps between blocks; a damaged block never reaches the
destination."""

from __future__ import annotations

import numpy as np
import pytest

from impress_cache import CorruptBlockError
from impress_cache.storage.base import ALIGN, align_up, checksum
from impress_cache.storage.placed import STAGE_BYTES, RowPlacement
from impress_cache.storage.reader import BlockReader, FileBlocks

HEADS, ROW = 3, 256  # a K or V row of one head: 64 float32


def _file(tmp_path, rows_per_block, padded):
    """Blocks ``uint8 [2, HEADS, rows, ROW]`` one after another (each 4 KiB aligned when
    ``padded``); returns the path, the blocks and their offsets."""
    rng = np.random.default_rng(len(rows_per_block))
    blocks, offsets, at = [], [], 0
    raw = bytearray()
    for rows in rows_per_block:
        b = rng.integers(0, 256, (2, HEADS, rows, ROW), dtype=np.uint8)
        at = align_up(at) if padded else at
        raw.extend(b"\0" * (at - len(raw)))
        raw.extend(b.tobytes())
        blocks.append(b)
        offsets.append(at)
        at += b.nbytes
    path = tmp_path / "blocks.bin"
    path.write_bytes(bytes(raw))
    return path, blocks, np.array(offsets, dtype=np.int64)


def _group(path, blocks, offsets, out, first_row=0, corrupt=None):
    rows = np.array([b.shape[2] for b in blocks], dtype=np.int64)
    at = np.concatenate([[0], np.cumsum(rows)[:-1]]) - first_row
    r0 = np.zeros(len(blocks), dtype=np.int64)
    r0[0] = first_row
    at[0] = 0
    seeds = np.arange(len(blocks), dtype=np.uint32) * 7919
    sums = [checksum(b.tobytes(), int(s)) for b, s in zip(blocks, seeds)]
    if corrupt is not None:
        sums[corrupt] ^= 1
    return FileBlocks(
        0, path, None, offsets, rows * 2 * HEADS * ROW, np.array(sums, dtype=np.uint32), seeds,
        np.zeros(len(blocks), dtype=np.int64), None, RowPlacement(out, at, r0, rows - r0, rows),
    )


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("inline", [False, True])
def test_rows_land_at_their_positions(tmp_path, padded, inline):
    rows_per_block = [16] * 70 + [5]  # 70 whole blocks of 24 KiB (several staging runs) and a short last one
    if not padded:
        rows_per_block = [15] * 70 + [5]  # 22.5 KiB blocks: not 4 KiB multiples, no padding between them
    path, blocks, offsets = _file(tmp_path, rows_per_block, padded)
    assert offsets[-1] > 2 * STAGE_BYTES
    total = sum(rows_per_block) - 3
    room = 4
    dest = np.full((2, 1, HEADS, total + room, ROW), 0xAB, dtype=np.uint8)
    out = dest[:, 0, :, :total]
    reader = BlockReader(threads=4)
    try:
        group = _group(path, blocks, offsets, out, first_row=3)
        reader.submit([group], memoryview(b""), inline=inline).wait()
    finally:
        reader.close()
    want = np.concatenate(blocks, axis=2)[:, :, 3:]
    assert np.array_equal(out, want)
    assert (dest[:, 0, :, total:] == 0xAB).all()  # the room after the rows untouched


def test_a_damaged_block_is_never_placed(tmp_path):
    path, blocks, offsets = _file(tmp_path, [16] * 60, True)
    out = np.full((2, HEADS, 16 * 60, ROW), 0xAB, dtype=np.uint8)
    reader = BlockReader(threads=2)
    try:
        bad = 45  # in the second share's runs
        with pytest.raises(CorruptBlockError, match="checksum mismatch"):
            reader.submit([_group(path, blocks, offsets, out, corrupt=bad)], memoryview(b"")).wait()
    finally:
        reader.close()
    assert (out[:, :, bad * 16 : (bad + 1) * 16] == 0xAB).all()
    assert offsets[bad] % ALIGN == 0


def test_a_placement_that_does_not_fit_is_refused(tmp_path):
    path, blocks, offsets = _file(tmp_path, [16] * 4, True)
    out = np.zeros((2, HEADS, 16 * 4 - 1, ROW), dtype=np.uint8)  # one row short
    reader = BlockReader(threads=1)
    try:
        with pytest.raises(ValueError, match="outside the destination"):
            reader.submit([_group(path, blocks, offsets, out)], memoryview(b""))
    finally:
        reader.close()


def test_an_error_in_one_group_is_raised_only_after_every_other_group_has_ended(tmp_path):
    """A group whose fetch fails at once (`StoreIOError`: out of descriptors, a remote
    that cannot be reached) while another is still being read: `ReadBatch.wait` raises
    only when the other has ended too, so no reader thread writes into a buffer its
    caller has already given up (and may be recomputing into)."""
    import threading

    from impress_cache.errors import StoreIOError

    path, blocks, offsets = _file(tmp_path, [16] * 8, True)
    out_a = np.zeros((2, HEADS, 128, ROW), dtype=np.uint8)
    out_b = np.zeros_like(out_a)
    a, b = _group(path, blocks, offsets, out_a), _group(path, blocks, offsets, out_b)
    ended = threading.Event()

    def fail():
        raise StoreIOError("out of descriptors")

    def slow():
        ended.wait(0.5)  # still fetching when the first group's error is known

    a.before, b.before = fail, slow
    reader = BlockReader(threads=2)
    try:
        batch = reader.submit([a, b], memoryview(b""))
        with pytest.raises(StoreIOError):
            batch.wait()
        assert batch.done()
        expect = np.concatenate(blocks, axis=2)
        assert np.array_equal(out_b, expect)  # the other group was read whole before the error
    finally:
        reader.close()
