"""Command line: inspect, verify and reorganise a store without loading a model.

    impress-cache info DIR      # model record, prompts, files, bytes
    impress-cache verify DIR    # read every block and check its CRC-32
    impress-cache verify --repair DIR   # rebuild the index from the chunk files' headers
    impress-cache reorg DIR     # rewrite nodes in the order their importance statistics call for
    impress-cache stats DIR     # prefixes, bytes, reuse and the model record (a store or a server's root)
    impress-cache prune DIR --to SIZE | --older-than AGE   # the disk budget, applied now
    impress-cache serve MODEL --store DIR   # an OpenAI-compatible server (docs/serving.md)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

import numpy as np

from . import probe as probe_codec
from .config import ImpressConfig
from .errors import CorruptBlockError
from .index.sqlite import Index
from .model_info import ModelSpec
from .storage import KV, PROBE, BlockReader, BlockTable, FileBlocks, file_seed
from .store.catalog import CHUNK_DIR
from .operate import OPERATOR_COMMANDS, add_operator_commands
from .store.store import INDEX_NAME


def _open_index(path: Path) -> Index:
    if not (path / INDEX_NAME).exists():
        raise SystemExit(f"{path} is not an impress_cache store (no {INDEX_NAME})")
    return Index(path / INDEX_NAME)


def _row_bytes(index: Index) -> tuple[int, int]:
    """Bytes of one row of a K/V block and of a probe piece, from the index's records."""
    model, probe = index.get_json("model"), index.get_json("probe")
    kv = ModelSpec.from_dict(model).kv_row_bytes
    return kv, probe_codec.record_bytes(len(probe["kv_heads"]), model["head_dim"], probe["encoding"])


def info(path: Path) -> dict:
    index = _open_index(path)
    try:
        tree, files = index.load_tree()
        return {
            "model": index.get_json("model"),
            "probe": index.get_json("probe"),
            "nodes": len(tree),
            "stored_prompts": sum(n.terminal for n in tree.nodes()),
            "files": len(files),
            "tokens_in_files": sum(f.n_tokens for f in files.values()),
            "bytes": index.total_bytes(),
        }
    finally:
        index.close()


def verify(path: Path) -> list[dict]:
    """Read every indexed block; return one entry per damaged or missing file."""
    index = _open_index(path)
    reader = BlockReader(threads=4)
    bad = []
    try:
        row_bytes = _row_bytes(index)
        for rec in tqdm(index.files(), desc="verifying", unit="file"):
            arrays = index.block_table(rec.id)
            assert arrays is not None
            perm = index.file_perm(rec.id) if rec.reordered else None
            seed = file_seed(bytes.fromhex(rec.name[:32]), rec.context, rec.first_pos, rec.tokens, perm)
            table = BlockTable.build(*arrays, seed, rec.n_tokens, rec.chunk_tokens, row_bytes)
            fpath = path / CHUNK_DIR / rec.name
            blocks = np.arange(rec.blocks)
            try:
                for kind in (KV, PROBE):
                    sizes = table.nbytes(kind, blocks)
                    dest = np.concatenate([[0], np.cumsum(sizes)[:-1]])
                    buf = memoryview(bytearray(int(sizes.sum())))
                    for layer in range(rec.layers):  # one layer at a time: bounded memory
                        group = FileBlocks(
                            rec.id, fpath, None, table.offsets[kind, layer], sizes,
                            table.checksums[kind, layer], table.seeds[kind, layer], dest,
                        )
                        reader.submit([group], buf).wait()
            except CorruptBlockError as exc:
                bad.append({"file": rec.name, "error": str(exc)})
    finally:
        reader.close()
        index.close()
    return bad


def repair_store(path: Path) -> dict:
    """Rebuild the index from the chunk files' headers (`store.repair`), then verify
    every block and quarantine the files that fail."""
    from .store.repair import repair
    from .store.store import ImpressStore

    result = repair(path)
    bad = verify(path)
    if bad:
        with ImpressStore(path, None) as store:
            ids = {name: fid for fid, name in store.index.file_names().items()}
            for b in bad:
                store.quarantine(ids[b["file"]], b["error"])
        result["files"] -= len(bad)
    result["damaged_files"] = bad
    return result


def reorg(path: Path, force: bool = False, limit: int | None = None, **config: object) -> dict:
    """Rewrite the nodes whose saved importance statistics call for a new order
    (``config``: `ImpressConfig` fields, e.g. the ``important_ratio`` the gain is
    judged for and the ``chunk_tokens`` of the new files)."""
    from .config import ImpressConfig
    from .store.store import ImpressStore

    _open_index(path).close()
    with ImpressStore(path, None, ImpressConfig(reorg_idle_ms=0, **config)) as store:  # type: ignore[arg-type]
        result = store.reorganize(force=force, limit=limit, progress=True)
        stats = store.stats()
    return {**result, "nodes": stats["nodes"], "files": stats["files"], "disk_bytes": stats["disk_bytes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="impress-cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info").add_argument("store", type=Path)
    v = sub.add_parser("verify", help="read every block and check its checksum")
    v.add_argument("store", type=Path)
    v.add_argument("--repair", action="store_true", help="rebuild the index from the chunk files' headers first")
    r = sub.add_parser("reorg", help="rewrite nodes in the order their importance statistics call for")
    r.add_argument("store", type=Path)
    r.add_argument("--force", action="store_true", help="every node with statistics, whatever the expected gain")
    r.add_argument("--limit", type=int, default=None, help="rewrite at most this many nodes")
    defaults = ImpressConfig()
    r.add_argument("--important-ratio", type=float, default=defaults.sparse_ratio, help="share of rows the gain is judged for")
    r.add_argument("--chunk-tokens", type=int, default=defaults.chunk_tokens, help="rows per block of the rewritten files")
    r.add_argument("--min-requests", type=int, default=defaults.reorg_min_requests, help="new sparse requests a node needs")
    r.add_argument("--min-gain", type=float, default=defaults.reorg_min_gain, help="fewer blocks the top rows must need")
    add_operator_commands(sub)
    args = p.parse_args(argv)
    if args.cmd in OPERATOR_COMMANDS:
        return OPERATOR_COMMANDS[args.cmd](args)
    if args.cmd == "info":
        print(json.dumps(info(args.store), indent=2))
        return 0
    if args.cmd == "reorg":
        result = reorg(
            args.store, args.force, args.limit, important_ratio=args.important_ratio, chunk_tokens=args.chunk_tokens,
            reorg_min_requests=args.min_requests, reorg_min_gain=args.min_gain,
        )
        print(json.dumps(result, indent=2))
        return 0
    if args.repair:
        result = repair_store(args.store)
        print(json.dumps(result, indent=2))
        return 0
    bad = verify(args.store)
    print(json.dumps({"damaged_files": bad}, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
