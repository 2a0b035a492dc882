"""Rebuilding a store's index from its chunk files (``impress-cache verify --repair``).

Chunk files describe themselves (header version 3): the model and probe settings, the
file's UUID, the whole token sequence up to its last row, the position of its first row,
its rows per block, every block's checksum and, for a reordered file, its row
permutation. The format gives each block's offset (`ChunkFormat.block_offsets`). The
repair reads those headers, inserts the files in order of their first position (a file
extends the prefix the files before it hold) into a new index, exactly as the writer
commits a prompt, and replaces the old index with it. Files whose header cannot be read,
that belong to another model (or another ``kv_codec``: a store never mixes codecs) or
whose prefix no other file holds are moved to ``quarantine/``; when the old index cannot
say which model the store is for, the model record most files hold decides (on a tie,
the first file's by name). `impress-cache verify --repair` then reads and verifies every
block of every indexed file (`cli.repair_store`) and quarantines a file that fails. Run
it while no process has the store open.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .. import probe as probe_codec
from ..errors import ImpressError
from ..index.sqlite import Index, NewFile
from ..model_info import ModelSpec, same_model
from ..storage import FORMATS
from ..storage.base import PROBE
from .binding import check_model_record, mark_codec
from .catalog import CHUNK_DIR, Catalog
from .chunkfiles import FILE_NAME
from .directory import dir_mode, ensure_dir
from .header import decode_header
from .namespaces import namespace_of, namespaced

log = logging.getLogger(__name__)

_SUFFIX = {cls.suffix: cls for cls in FORMATS.values()}


def read_header(path: Path, fmt: Any) -> tuple[NewFile, np.ndarray, dict[str, Any], dict[str, Any]]:
    """A chunk file's index record from its own header (read once): ``(new file, whole
    token sequence, model record, probe record)``. Raises ``ValueError``/``KeyError``/
    ``OSError`` when the header is incomplete, of another version or inconsistent."""
    h = decode_header(fmt.read_metadata(path))
    if h.layers != h.model["num_layers"] or f"{h.uuid}.{fmt.suffix}" != path.name:
        raise ValueError("header fields disagree with each other or with the file name")
    row_bytes = _row_bytes(h.model, h.probe)
    offsets = h.offsets(fmt.block_offsets(path), row_bytes[PROBE])
    return h.new_file(fmt.suffix, offsets, row_bytes, os.stat(path).st_size), h.tokens, h.model, h.probe


def _row_bytes(model: dict[str, Any], probe: dict[str, Any]) -> tuple[int, int]:
    """Bytes of one row in a K/V block and in a probe piece, from the records a header holds."""
    kv_row = ModelSpec.from_dict(model).kv_row_bytes  # (encoded with the record's kv_codec, if any)
    return kv_row, probe_codec.record_bytes(len(probe["kv_heads"]), model["head_dim"], probe["encoding"])


def repair(path: Path, file_mode: int = 0o600) -> dict[str, Any]:
    """Rebuild ``path``'s index from its chunk files; returns what was indexed and what
    was quarantined (``files`` indexed, ``unused`` files whose rows other files hold,
    ``nodes``, ``quarantined``: names and reasons)."""
    path = Path(path)
    chunks = path / CHUNK_DIR
    model = probe = None
    spaces: dict[int, str] = {}  # the namespaces' ids (files of a namespace the index lost go aside)
    if (path / "index.sqlite").exists():
        try:  # what the old index recorded, if it still can say
            old = Index(path / "index.sqlite", read_only=True)
            try:
                model, probe = old.get_json("model"), old.get_json("probe")
                check_model_record(old, model)  # a damaged record is not used: the headers say
                spaces = old.namespaces()
            finally:
                old.close()
        except ImpressError:  # a damaged index: the files' headers say what it held
            model = probe = None
    found, bad = [], []
    for entry in sorted(os.scandir(chunks), key=lambda e: e.name):
        name = entry.name
        if not FILE_NAME.match(name) or not entry.is_file(follow_symlinks=False):
            if name.endswith(".tmp") and FILE_NAME.match(name[:-4]):
                os.unlink(entry.path)  # a write that never finished
            elif FILE_NAME.match(name):
                bad.append((name, "not a regular file"))
            continue
        fmt = _SUFFIX[name.rsplit(".", 1)[1]]()
        try:
            found.append((name, entry.stat().st_mtime, *read_header(Path(entry.path), fmt)))
        except Exception as exc:  # any damage of a header: the file cannot be indexed
            bad.append((name, f"unreadable header ({type(exc).__name__}: {exc})"))
    if model is None and found:  # the index cannot say: the model record most files hold (ties: the first name)
        votes = Counter(json.dumps(f[4], sort_keys=True) for f in found)
        model = json.loads(votes.most_common(1)[0][0])
    headers = []
    for name, mtime, new, seq, meta_model, meta_probe in found:
        if meta_model.get("kv_codec") != model.get("kv_codec"):  # never two codecs in one store
            bad.append((name, f"written with kv_codec={meta_model.get('kv_codec')!r}, the store keeps kv_codec={model.get('kv_codec')!r}"))
            continue
        try:
            if same_model(meta_model, model):
                probe = probe or {k: meta_probe[k] for k in ("query_heads", "kv_heads", "encoding") if k in meta_probe}
            if not same_model(meta_model, model) or {k: meta_probe[k] for k in ("kv_heads", "encoding")} != {
                k: probe[k] for k in ("kv_heads", "encoding")
            }:
                raise ValueError("written for another model or probe setting")
            if namespaced(seq) and namespace_of(seq[0], model["vocab_size"]) not in spaces:
                raise ValueError("a prefix of a namespace the index no longer names")
            headers.append((new.first_pos, mtime, new, seq))
        except Exception as exc:  # a header that does not fit the store
            bad.append((name, f"unreadable header ({type(exc).__name__}: {exc})"))
    if model is None:
        raise SystemExit(f"{path}: no chunk file has a readable header and the index records no model; nothing to repair")
    if probe is not None and "query_heads" not in probe:  # older headers: the first query head of each group
        group = model["num_attention_heads"] // model["num_kv_heads"]
        probe = {"query_heads": [h * group for h in probe["kv_heads"]], **probe}
    tmp = path / "index.sqlite.repair"
    for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        if p.exists():
            p.unlink()
    index = Index(tmp, file_mode=file_mode)
    index.get_or_set_json("model", model)
    check_model_record(index, model)  # (records its checksum)
    mark_codec(index, model)
    index.get_or_set_json("probe", probe)
    if spaces:
        index.keep_namespaces(spaces)
    catalog = Catalog(path, index, _row_bytes(model, probe), lambda ids, records: None)
    indexed = 0
    try:
        for _, _, new, seq in sorted(headers, key=lambda h: (h[0], h[1])):
            # None: its prefix is in no other file, or its rows are held already; left
            # unindexed, the next open removes it
            if catalog.commit_prompt(seq, new.first_pos, new) is not None:
                indexed += 1
        nodes = len(catalog.tree)
    finally:
        catalog.close()
        index.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{path / 'index.sqlite'}{suffix}").unlink(missing_ok=True)
    os.replace(tmp, path / "index.sqlite")
    qdir = path / "quarantine"
    if bad:
        ensure_dir(qdir, dir_mode(file_mode), "the quarantine folder")
        for name, _ in bad:
            try:
                os.replace(chunks / name, qdir / name)
            except OSError:
                pass
    for name, reason in bad:
        log.warning("repair: quarantined %s (%s)", name, reason)
    return {"files": indexed, "unused": len(headers) - indexed, "nodes": nodes, "quarantined": [{"file": n, "reason": r} for n, r in bad]}
