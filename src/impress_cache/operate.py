"""Operators' commands of ``impress-cache``: ``serve``, ``stats`` and ``prune``.

``stats`` and ``prune`` open a store without a model (like ``reorg``), so they are safe
while a server uses it: the store is made for several processes, and ``prune`` is the
store's own disk budget (`ImpressStore.enforce_disk_budget`) applied once.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ImpressConfig
from .index.sqlite import Index
from .store.gc import wal_bound
from .store.store import INDEX_NAME, ImpressStore

log = logging.getLogger(__name__)

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
               "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``"500M"``, ``"2GiB"``, ``"123456"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 500M, 2G, 1048576)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_age(text: str) -> float:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"`` (or plain seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not an age: {text!r} (examples: 30d, 12h, 90m, 45s)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2) or "s"]


def store_dirs(path: Path) -> dict[str, Path]:
    """The stores under ``path``: itself if it is a store, else a server's root
    (``default`` and ``tenants/*``, `serve.tenancy`). Empty if there is none."""
    if (path / INDEX_NAME).exists():
        return {".": path}
    found = {"default": path / "default"} if (path / "default" / INDEX_NAME).exists() else {}
    tenants = path / "tenants"
    if tenants.is_dir():
        found.update({f"tenants/{d.name}": d for d in sorted(tenants.iterdir()) if (d / INDEX_NAME).exists()})
    return found


def _stores_or_exit(path: Path) -> dict[str, Path]:
    found = store_dirs(path)
    if not found:
        raise SystemExit(f"{path} is not an impress_cache store (no {INDEX_NAME}) nor a server's store root")
    return found


# -- stats ---------------------------------------------------------------------------
def last_uses(index: Index) -> dict[int, float]:
    """Wall-clock time of each node's last use (its write counts as one), from the node
    statistics saved in the index (a running store saves them every ``stats_interval_s``
    and on ``flush``); nodes without saved statistics are missing."""
    ids, cols = index.load_node_stats()
    # columns: count, freq, share, age_s, seq, saved_at
    return {int(i): float(c[5] - c[3]) for i, c in zip(ids, cols)}


def store_stats(path: Path) -> dict[str, Any]:
    """Prefixes, bytes, reuse and the model record of one store (read without a model)."""
    index = Index(path / INDEX_NAME, read_only=True)
    try:
        tree, files = index.load_tree()
        _, cols = index.load_node_stats()
        model = index.get_json("model")
        nodes = list(tree.nodes())
        disk = index.footprint() + sum(f.file_bytes for f in files.values())
    finally:
        index.close()
    counts = cols[:, 0] if len(cols) else cols
    reused = int((counts > 0).sum()) if len(cols) else 0
    return {
        "model": model,
        # distinct stored prompts (a prompt stored twice counts once), and prompts stored in all
        "prefixes": sum(n.terminal > 0 for n in nodes),
        "stored_prompts": sum(n.terminal for n in nodes),
        "nodes": len(nodes),
        "files": len(files),
        "tokens_stored": sum(f.n_tokens for f in files.values()),
        "disk_bytes": disk,
        # reuse, from the saved node statistics (requests that matched nothing leave no trace in a store)
        "nodes_reused": reused,
        "node_reuse_rate": reused / len(nodes) if nodes else 0.0,
        "reuses": int(counts.sum()) if len(cols) else 0,
    }


def stats_command(args: argparse.Namespace) -> int:
    stores = {name: store_stats(p) for name, p in _stores_or_exit(args.store).items()}
    out: dict[str, Any] = stores["."] if list(stores) == ["."] else {"stores": stores}
    serving = args.store / "serving-stats.json"
    if serving.exists():  # the counters a server keeps at its root (requests, tokens, hit rates)
        out["serving"] = json.loads(serving.read_text())
    print(json.dumps(out, indent=2))
    return 0


# -- prune ---------------------------------------------------------------------------
def prune(path: Path, to: int | None = None, older_than: float | None = None) -> dict[str, Any]:
    """Apply a disk budget to the store at ``path`` now: ``to`` bytes, or the bytes the
    store would take without the prefixes unused for ``older_than`` seconds.

    Both run the store's own disk budget (`ImpressStore.enforce_disk_budget`, the least
    valuable free prefixes first). For ``older_than`` the store is opened with the LRU
    policy, so the least recently used prefixes go first, and the budget is the store's
    size less the files that only old prefixes (with no younger prefix below them) use:
    those, and no younger prefix, are removed. Prefixes a request of this process leases
    are never removed; a server using the store sees the removals like any other
    process's commit."""
    if (to is None) == (older_than is None):
        raise ValueError("give exactly one of to= and older_than=")
    if older_than is not None:
        to = _budget_without_old(path, time.time() - older_than)
        if to is None:
            return {"removed_prefixes": 0, "removed_files": 0, "freed_bytes": 0, "disk_bytes": None, "budget": None}
    assert to is not None
    config = ImpressConfig(disk_bytes=max(1, to), policy="lru" if older_than is not None else "score", reorg_idle_ms=None)
    with ImpressStore(path, None, config) as store:
        before = store.disk_bytes()
        result = store.enforce_disk_budget()
        stats = store.stats()
    return {**result, "disk_bytes_before": before, "nodes": stats["nodes"], "files": stats["files"]}


def _budget_without_old(path: Path, cutoff: float) -> int | None:
    """The budget that frees exactly the files of prefixes last used before ``cutoff``
    (None: nothing to free)."""
    index = Index(path / INDEX_NAME, read_only=True)
    try:
        tree, files = index.load_tree()
        used = last_uses(index)
    finally:
        index.close()
    nodes = [n for n in tree.nodes() if n.parent is not None]
    young_files: set[int] = set()
    old: set[int] = set()
    for node in sorted(nodes, key=lambda n: -_depth(n)):  # children before parents
        kids_old = all(k.id in old for k in _children(node))
        if kids_old and used.get(node.id, float("inf")) < cutoff:
            old.add(node.id)
        else:
            young_files.add(node.file_id)
    old_files = [f.file_bytes for f in files.values() if f.id in {n.file_id for n in nodes} - young_files]
    if not old_files:
        return None
    with ImpressStore(path, None, ImpressConfig(reorg_idle_ms=None)) as store:  # its own measure of its size
        disk, wal = store.disk_bytes(), store.index.wal_bytes()
    # the least recently used leaves go first: the budget stops once every old file is
    # gone (the slack, less than any old file, absorbs rounding) and before a young one
    slack = min(old_files) // 2
    budget = disk - sum(old_files) + slack
    for _ in range(8):  # the budget keeps room for the WAL (`wal_bound` of the budget)
        budget = disk - sum(old_files) + max(0, wal_bound(budget) - wal) + slack
    return budget


def _depth(node: Any) -> int:
    d = 0
    while node.parent is not None:
        node, d = node.parent, d + 1
    return d


def _children(node: Any) -> list[Any]:
    return list(node.children.values())


def prune_command(args: argparse.Namespace) -> int:
    results = {name: prune(p, args.to, args.older_than) for name, p in _stores_or_exit(args.store).items()}
    print(json.dumps(results["."] if list(results) == ["."] else {"stores": results}, indent=2))
    return 0


# -- serve ---------------------------------------------------------------------------
def serve_command(args: argparse.Namespace) -> int:
    from .serve import serve  # (the library never imports serve/ otherwise)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ImpressConfig(important_ratio=args.important_ratio, disk_bytes=args.disk_bytes)
    serve(args.model, args.store, args.host, args.port, config, args.model_id, args.max_open_stores,
          answer_ids=args.answer_ids)
    return 0


def add_operator_commands(sub: Any) -> None:
    """Add ``serve``, ``stats`` and ``prune`` to the CLI's subcommands."""
    s = sub.add_parser("stats", help="prefixes, bytes, reuse and the model record of a store or a server's root")
    s.add_argument("store", type=Path)
    pr = sub.add_parser("prune", help="apply a disk budget now (safe while a server uses the store)")
    pr.add_argument("store", type=Path)
    how = pr.add_mutually_exclusive_group(required=True)
    how.add_argument("--to", type=parse_size, help="shrink each store to this size (500M, 2G, bytes)")
    how.add_argument("--older-than", type=parse_age, help="remove prefixes unused for this long (30d, 12h, 90m)")
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server of MODEL over the stores under --store")
    sv.add_argument("model", type=Path, help="a Hugging Face model directory or a .gguf file")
    sv.add_argument("--store", type=Path, required=True, help="root directory of the stores (one per tenant)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--model-id", default=None, help="the name clients use (default: the directory's or file's name)")
    sv.add_argument("--important-ratio", type=float, default=1.0, help="1.0 (default): exact reuse")
    sv.add_argument("--disk-bytes", type=parse_size, default=None, help="disk budget of each tenant's store")
    sv.add_argument("--max-open-stores", type=int, default=8, help="tenants' stores kept open at once")
    sv.add_argument("--answer-ids", action="store_true",
                    help="put recent answers' generated token ids back in place of their re-tokenized text in later chat "
                         "prompts: more of each turn matches, but answers can differ from a server that tokenizes the text")


#: subcommand -> handler
OPERATOR_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "stats": stats_command, "prune": prune_command, "serve": serve_command,
}
