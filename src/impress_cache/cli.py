"""Command line: inspect and verify a store without loading a model.

    impress-cache info DIR      # model record, prompts, files, bytes
    impress-cache verify DIR    # read every block and check its CRC-32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from .errors import CorruptBlockError
from .index.sqlite import Index
from .storage import BlockReader, Extent
from .store.catalog import CHUNK_DIR
from .store.store import INDEX_NAME


def _open_index(path: Path) -> Index:
    if not (path / INDEX_NAME).exists():
        raise SystemExit(f"{path} is not an impress_cache store (no {INDEX_NAME})")
    return Index(path / INDEX_NAME)


def info(path: Path) -> dict:
    index = _open_index(path)
    try:
        tree = index.load_tree()
        files = index.files()
        return {
            "model": index.get_json("model"),
            "probe": index.get_json("probe"),
            "nodes": len(tree),
            "stored_prompts": sum(n.terminal for n in tree.nodes()),
            "files": len(files),
            "tokens_in_files": sum(f.n_tokens for f in files),
            "bytes": sum(f.nbytes for f in files),
        }
    finally:
        index.close()


def verify(path: Path) -> list[dict]:
    """Read every indexed block; return one entry per damaged or missing file."""
    index = _open_index(path)
    reader = BlockReader(threads=4)
    bad = []
    try:
        for rec in tqdm(index.files(), desc="verifying", unit="file"):
            fpath = path / CHUNK_DIR / rec.name
            blocks = list(index.blocks(rec.id).values())
            buf = memoryview(bytearray(max((b.nbytes for b in blocks), default=0) * len(blocks)))
            size = max((b.nbytes for b in blocks), default=0)
            extents = [
                Extent(rec.id, fpath, b.offset, b.nbytes, b.checksum, buf[i * size : (i + 1) * size])
                for i, b in enumerate(blocks)
            ]
            try:
                reader.read_into(extents)
            except CorruptBlockError as exc:
                bad.append({"file": rec.name, "error": str(exc)})
    finally:
        reader.close()
        index.close()
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="impress-cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("info", "verify"):
        sub.add_parser(name).add_argument("store", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "info":
        print(json.dumps(info(args.store), indent=2))
        return 0
    bad = verify(args.store)
    print(json.dumps({"damaged_files": bad}, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
