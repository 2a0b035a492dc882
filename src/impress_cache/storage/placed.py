"""Blocks read through a small staging buffer, verified, and placed row by row.

The read path's usual destination is a pool with one slot per block, from which the
rows are copied out again (`PrefixLayout.gather`). A dense layer wants every row of its
blocks in its own buffer, ``[2, kv_heads, positions, head_dim]``: there, a block's rows
of one (K or V, head) lie at the head's stride, not next to each other as on disk. This
module reads a run of neighbouring blocks with one ``preadv`` into a per-thread staging
buffer small enough to stay in the processor's cache, verifies every block's checksum
there (before any of its bytes reach the destination), then copies each block's rows to
their positions: a run of whole blocks that continue each other in the file and in the
destination with one strided copy. Every byte crosses main memory once on the way from
the page cache to the layer's buffer, and no K/V byte is written anywhere before it is
verified.

Torch-free: the destination is a numpy ``uint8`` view of the buffer (any dtype, bfloat16
included, moves as raw bytes).
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import numpy as np

#: bytes of neighbouring blocks read (and verified, and placed) at once: a cache-sized run
STAGE_BYTES = 512 * 2**10


@dataclass(frozen=True)
class RowPlacement:
    """Where the rows of a `FileBlocks` group go (arrays indexed like the group's blocks).

    ``out`` is a ``uint8 [2, heads, positions, row]`` array (``row``: one K or V row of
    one head in bytes; the last axis contiguous). Block ``i``, ``[2, heads, rows[i],
    row]`` on disk, gives its rows ``r0[i] .. r0[i] + count[i]`` to positions ``at[i] ..``
    of every (K or V, head).
    """

    out: np.ndarray
    at: np.ndarray  # int64
    r0: np.ndarray  # int64
    count: np.ndarray  # int64
    rows: np.ndarray  # int64

    def check(self, nbytes: np.ndarray) -> None:
        """Raise ``ValueError`` unless every block's rows fit it and the destination."""
        two, heads, positions, row = self.out.shape
        if two != 2 or self.out.strides[3] != 1:
            raise ValueError("the destination must be uint8 [2, heads, positions, row] with contiguous rows")
        if np.any(nbytes != self.rows * (2 * heads * row)):
            raise ValueError("block sizes do not match the destination's heads and row bytes")
        if np.any((self.r0 < 0) | (self.count < 0) | (self.r0 + self.count > self.rows)):
            raise ValueError("a block's rows lie outside the block")
        if np.any((self.at < 0) | (self.at + self.count > positions)):
            raise ValueError("a block's rows lie outside the destination")


_stage = threading.local()
#: an anonymous mapping of this process only (copied on write by a forked child)
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


def stage_buffer(nbytes: int) -> memoryview:
    """This thread's staging buffer, at least ``nbytes`` long (kept for the next run):
    private anonymous memory, page-aligned as ``O_DIRECT`` reads need it (``mmap``'s
    default, a shared mapping, would be the same memory in a forked child)."""
    buf = getattr(_stage, "buf", None)
    if buf is None or len(buf) < nbytes:
        size = -(-max(nbytes, STAGE_BYTES) // mmap.PAGESIZE) * mmap.PAGESIZE
        buf = _stage.buf = mmap.mmap(-1, size, **_PRIVATE)
    return memoryview(buf)[:nbytes]


def place(p: RowPlacement, idx: np.ndarray, rel: np.ndarray, nbytes: np.ndarray, stage: memoryview) -> None:
    """Copy the verified blocks ``idx`` (sorted by file offset; block ``idx[j]`` at
    ``rel[j]`` of ``stage``, ``nbytes[j]`` long) to their positions in ``p.out``."""
    out = p.out
    _, heads, _, row = out.shape
    src_all = np.frombuffer(stage, dtype=np.uint8)
    at, r0, cnt, rows = p.at[idx], p.r0[idx], p.count[idx], p.rows[idx]
    whole = (r0 == 0) & (cnt == rows)
    join = np.zeros(len(idx), dtype=bool)
    if len(idx) > 1:  # block j continues block j - 1 in the file and in the destination
        join[1:] = (
            whole[1:] & whole[:-1] & (rows[1:] == rows[:-1]) & (rel[1:] == rel[:-1] + nbytes[:-1])
            & (at[1:] == at[:-1] + rows[:-1])
        )
    cuts = [*np.flatnonzero(~join).tolist(), len(idx)]
    s0, s1, s2, s3 = out.strides
    for a, b in zip(cuts[:-1], cuts[1:]):
        m, s, first = b - a, int(rows[a]), int(rel[a])
        src = src_all[first : first + m * 2 * heads * s * row].reshape(m, 2, heads, s, row)
        if m == 1:
            lo, c, dst_at = int(r0[a]), int(cnt[a]), int(at[a])
            np.copyto(out[:, :, dst_at : dst_at + c], src[0, :, :, lo : lo + c])
            continue
        span = out[:, :, int(at[a]) : int(at[a]) + m * s]  # m whole blocks: one strided copy
        dst = np.lib.stride_tricks.as_strided(span, (2, heads, m, s, row), (s0, s1, s * s2, s2, s3), writeable=True)
        np.copyto(dst, src.transpose(1, 2, 0, 3, 4))
