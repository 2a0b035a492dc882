"""The self-description every chunk file carries in its header (written by `writer`),
read back in one place: by the index repair (`repair.read_header`) and by the remote
tier's check of a downloaded object (`remote.objects.parse_object`).

The header's metadata (strings) holds the format version (`FILE_FORMAT`), the file's
UUID, the model and probe records (JSON), the position of its first row, its rows, rows
per block and layers, the token ids of the whole sequence up to its last row and every
block's checksum (base64, little-endian), and for a reordered file its row permutation.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..index.files import NewFile
from ..storage.base import KV, PROBE, context_digest

#: the header version this code writes and reads
FILE_FORMAT = "3"


def b64(a: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode()


def _array(meta: Mapping[str, str], key: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta[key]), dtype=dtype)


@dataclass(frozen=True)
class ChunkHeader:
    """What a chunk file's header says of it."""

    uuid: str  # 32 hex digits: the file's name without its suffix
    first_pos: int
    n_tokens: int
    chunk_tokens: int
    layers: int
    #: the token ids of the whole sequence up to the file's last row (int64)
    tokens: np.ndarray
    checksums: np.ndarray  # uint32 [2, layers, blocks]
    perm: np.ndarray | None  # int32 [layers, n_tokens]
    model: dict[str, Any]
    probe: dict[str, Any]

    @property
    def block_rows(self) -> np.ndarray:
        """Rows of each block (the last one may hold fewer)."""
        nb = self.checksums.shape[2]
        return np.minimum(self.chunk_tokens, self.n_tokens - np.arange(nb) * self.chunk_tokens)

    def offsets(self, placed: Mapping[str, int], probe_row_bytes: int) -> np.ndarray:
        """Every block's byte offset ``[kind, layer, block]``, from where the format
        placed each tensor (``placed``: ``L{layer}.B{block}`` and ``P{layer}`` to their
        first byte in the file); raises `KeyError` for a tensor the file lacks."""
        nb = self.checksums.shape[2]
        out = np.zeros((2, self.layers, nb), dtype=np.int64)
        for layer in range(self.layers):
            for b in range(nb):
                out[KV, layer, b] = placed[f"L{layer}.B{b}"]
            out[PROBE, layer] = placed[f"P{layer}"] + np.arange(nb) * self.chunk_tokens * probe_row_bytes
        return out

    def new_file(self, suffix: str, offsets: np.ndarray, row_bytes: tuple[int, int], file_bytes: int) -> NewFile:
        """The file's index record."""
        n, first = self.n_tokens, self.first_pos
        return NewFile(
            f"{self.uuid}.{suffix}", suffix, first, self.tokens[first:].copy(), context_digest(self.tokens[:first]),
            self.chunk_tokens, self.layers, offsets, self.checksums, self.layers * n * sum(row_bytes), file_bytes,
            self.perm,
        )


def decode_header(meta: Mapping[str, str]) -> ChunkHeader:
    """A chunk file's header metadata, checked for its version and for fields that
    disagree with each other; raises `ValueError`, `KeyError` or `TypeError` otherwise."""
    if meta.get("impress_cache") != FILE_FORMAT:
        raise ValueError(f"header version {meta.get('impress_cache')!r}, not {FILE_FORMAT}")
    uid = meta["uuid"]
    if not isinstance(uid, str) or not re.fullmatch(r"[0-9a-f]{32}", uid):
        raise ValueError("header UUID is not 32 hex digits")
    first, n, ct, layers = (int(meta[k]) for k in ("first_pos", "n_tokens", "chunk_tokens", "layers"))
    tokens = _array(meta, "tokens", "<i4").astype(np.int64)
    if len(tokens) != first + n or first < 0 or n < 1 or ct < 1 or layers < 1:
        raise ValueError("header fields disagree with each other")
    nb = -(-n // ct)
    checksums = _array(meta, "checksums", "<u4").reshape(2, layers, nb).copy()
    perm = _array(meta, "perm", "<i4").reshape(layers, n).copy() if "perm" in meta else None
    model, probe = json.loads(meta["model"]), json.loads(meta["probe"])
    if not isinstance(model, dict) or not isinstance(probe, dict):
        raise ValueError("header model or probe record is not a JSON object")
    return ChunkHeader(uid, first, n, ct, layers, tokens, checksums, perm, model, probe)
