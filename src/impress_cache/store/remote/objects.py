"""What the remote tier stores, and how a downloaded object is checked before use.

Names (all below ``m-<namespace>/``, the namespace a digest of the model spec and the
probe settings, so stores of different models never meet):

``obj/<h>.<uuid>``  a chunk file, byte for byte as the store wrote it; ``h`` = SHA-256 of
             the namespace, the file's first position and the token ids of the whole
             sequence up to its last row, ``uuid`` the file's own (its local name): two
             files never share a name, even with the same tokens (two hosts that stored
             one prompt, a node rewritten by the reorganiser). Immutable: a name always
             means the same bytes.
``man/<h>``  a manifest: the token ids of one stored prompt and the objects (in
             position order) that hold its rows. Immutable; written after its objects.
``key/<h>``  a lookup key: ``h`` = SHA-256 of the namespace and the token ids of a
             prefix that ends at a boundary (`boundaries`); holds the name of a
             manifest whose prompt starts with that prefix. Written last.
``use/<h>.<uuid>``  an empty marker rewritten when a host imports or re-advertises
             ``obj/<h>.<uuid>`` (its recency).

A downloaded object is used only after `parse_object` has checked it completely: its
header names this model and probe setting, its tokens are the ones the manifest and the
name promise, and every block's CRC-32C (seeded by the file's identity, as on disk)
matches. Anything else is `BadObject`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

from ...index.sqlite import NewFile
from ...model_info import ModelSpec, same_model
from ...storage.base import KV, PROBE, block_seeds, checksum, file_seed
from ..binding import ProbeSpec
from ..header import decode_header

MANIFEST_VERSION = 1
_SMALLEST_BOUNDARY = 16


class BadObject(ValueError):
    """A remote object that must not be used (damaged, foreign, or not what its name says)."""


def namespace(spec: ModelSpec, probe: ProbeSpec) -> str:
    """Digest of everything that makes K/V and probe copies of two stores interchangeable."""
    ident = {"model": spec.to_dict(), "probe": {"kv_heads": list(probe.kv_heads), "encoding": probe.encoding}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def _tok_bytes(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


def object_name(ns: str, first_pos: int, tokens: np.ndarray, uid: bytes) -> str:
    """The name of a chunk file's object: its tokens' digest and its UUID."""
    h = hashlib.sha256(f"{ns}/obj/{first_pos}/".encode() + _tok_bytes(tokens)).hexdigest()[:40]
    return f"m-{ns}/obj/{h}.{uid.hex()}"


def key_name(ns: str, prefix: np.ndarray) -> str:
    h = hashlib.sha256(f"{ns}/key/".encode() + _tok_bytes(prefix)).hexdigest()[:40]
    return f"m-{ns}/key/{h}"


def manifest_name(ns: str, tokens: np.ndarray, objects: list[str]) -> str:
    h = hashlib.sha256(f"{ns}/man/{','.join(objects)}/".encode() + _tok_bytes(tokens)).hexdigest()[:40]
    return f"m-{ns}/man/{h}"


def use_name(obj: str) -> str:
    ns, _, h = obj.partition("/obj/")
    return f"{ns}/use/{h}"


def boundaries(length: int, key_tokens: int) -> list[int]:
    """Prefix lengths that get a lookup key: powers of two from 16 below ``key_tokens``,
    then every multiple of ``key_tokens``; at most ``length``."""
    out = []
    b = _SMALLEST_BOUNDARY
    while b < key_tokens and b <= length:
        out.append(b)
        b *= 2
    out.extend(range(key_tokens, length + 1, key_tokens))
    return out


@dataclass(frozen=True)
class ChainEntry:
    object: str
    start: int
    end: int
    size: int


@dataclass(frozen=True)
class Manifest:
    tokens: np.ndarray
    chain: tuple[ChainEntry, ...]

    def encode(self) -> bytes:
        return json.dumps({
            "v": MANIFEST_VERSION,
            "tokens": base64.b64encode(_tok_bytes(self.tokens)).decode(),
            "chain": [[c.object, c.start, c.end, c.size] for c in self.chain],
        }).encode()

    @classmethod
    def decode(cls, raw: bytes, ns: str) -> Manifest:
        try:
            d = json.loads(raw)
            if d.get("v") != MANIFEST_VERSION:
                raise BadObject(f"manifest version {d.get('v')!r}")
            tokens = np.frombuffer(base64.b64decode(d["tokens"]), dtype="<i4").astype(np.int64)
            chain = tuple(ChainEntry(str(o), int(s), int(e), int(n)) for o, s, e, n in d["chain"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BadObject(f"unreadable manifest: {exc}") from exc
        pos = 0
        for c in chain:
            if not c.object.startswith(f"m-{ns}/obj/") or not c.start <= pos < c.end or c.end > len(tokens):
                raise BadObject("manifest chain does not cover its tokens in order")
            pos = c.end
        if pos != len(tokens):
            raise BadObject("manifest chain does not cover its tokens")
        return cls(tokens, chain)


@dataclass
class ParsedObject:
    """A checked chunk file: its index record, the whole sequence it extends, its uuid
    name (local), where its blocks start and its object name (remote)."""

    new_file: NewFile
    tokens: np.ndarray
    file_name: str
    data_start: int
    object: str


def header_length(data: bytes) -> int:
    """Bytes before a chunk file's first block (its header), from its first 8 bytes."""
    if len(data) < 8:
        raise BadObject("object shorter than a header")
    return 8 + struct.unpack("<Q", data[:8])[0]


def _safetensors_header(data: bytes) -> tuple[dict, int]:
    """A chunk file's header and the offset of its first block."""
    data_start = header_length(data)
    if data_start > len(data):
        raise BadObject("header larger than the object")
    try:
        header = json.loads(data[8:data_start])
    except ValueError as exc:
        raise BadObject(f"unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise BadObject("unreadable header: not a JSON object")
    return header, data_start


def parse_object(
    data: bytes, name: str | None, ns: str, spec: ModelSpec, probe: ProbeSpec, row_bytes: tuple[int, int],
    size: int | None = None,
) -> ParsedObject:
    """Check a downloaded chunk file completely (see the module docstring) and return its
    index record. With ``size`` (the object's size), ``data`` may be its header only:
    the blocks are then verified when they are read (`lazy`). ``name=None``: a local
    file about to be uploaded; its object name is derived from its header
    (`ParsedObject.object`)."""
    verify = size is None
    size = len(data) if size is None else size
    header, data_start = _safetensors_header(data)
    try:
        h = decode_header(header.get("__metadata__") or {})
    except (KeyError, ValueError, TypeError) as exc:
        raise BadObject(f"object header incomplete or of another version: {exc}") from exc
    if not same_model(h.model, spec.to_dict()):
        raise BadObject("object of another model")
    if list(h.probe.get("kv_heads", ())) != list(probe.kv_heads) or h.probe.get("encoding") != probe.encoding:
        raise BadObject("object with other probe settings")
    if h.layers != spec.num_layers:
        raise BadObject("object header inconsistent")
    uid = bytes.fromhex(h.uuid)
    own = object_name(ns, h.first_pos, h.tokens, uid)
    if name is not None and own != name:
        raise BadObject("object does not hold the tokens its name promises")
    placed, sizes = {}, h.block_rows
    try:
        for layer in range(h.layers):
            for b, rows in enumerate(sizes.tolist()):
                start, end = header[f"L{layer}.B{b}"]["data_offsets"]
                placed[f"L{layer}.B{b}"] = data_start + start
                if end - start != rows * row_bytes[KV]:
                    raise BadObject("block of the wrong size")
            p0, p1 = header[f"P{layer}"]["data_offsets"]
            placed[f"P{layer}"] = data_start + p0
            if p1 - p0 != h.n_tokens * row_bytes[PROBE]:
                raise BadObject("probe copy of the wrong size")
    except (KeyError, TypeError, ValueError) as exc:
        raise BadObject(f"object header incomplete: {exc}") from exc
    offsets = h.offsets(placed, row_bytes[PROBE])
    ends = offsets + sizes[None, None, :] * np.array(row_bytes, dtype=np.int64)[:, None, None]
    if offsets.min() < data_start or ends.max() > size:
        raise BadObject("object truncated")
    new_file = h.new_file("safetensors", offsets, row_bytes, size)
    if verify:
        seeds = block_seeds(
            file_seed(uid, new_file.context, h.first_pos, new_file.tokens, h.perm), *np.indices(h.checksums.shape)
        )
        view = memoryview(data)
        for idx in np.ndindex(*h.checksums.shape):
            if checksum(view[offsets[idx] : ends[idx]], int(seeds[idx])) != int(h.checksums[idx]):
                raise BadObject(f"block {idx} fails its checksum")
    return ParsedObject(new_file, h.tokens, new_file.name, data_start, own)
