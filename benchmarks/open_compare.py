"""Open one kept store with two versions of the code, alternated, in fresh processes.

    python benchmarks/open_compare.py STORE --src OLD/src --src NEW/src [--rounds 5] [--out F]

``STORE`` is a store kept by ``benchmarks/scale.py --keep DIR`` (``DIR/store``); each
``--src`` is the ``src`` directory of a checkout (``git worktree add /tmp/old <commit>``
gives an older one). Every round opens the store once with each version, in turn, so a
slow spell of the shared machine lands on both; each open is `scale.py`'s (a fresh
process, no memory tiers, ``ImpressStore(path, None)``: until the constructor returns,
and until the writer thread's deferred jobs are done). Prints and writes (``--out``)
per version the best and median ``open_s``, the median ``ready_s`` and bytes of resident
memory per stored token, and every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import open_once  # noqa: E402 - the same open as the scale benchmark's


def commit_of(src: Path) -> str | None:
    """The commit of the checkout ``src`` belongs to (``None`` outside git)."""
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path)
    ap.add_argument("--src", type=Path, action="append", required=True, help="a src directory (give two or more)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not (args.store / "index.sqlite").is_file():
        raise SystemExit(f"{args.store} is not a store (no index.sqlite)")
    runs: dict[str, list[dict]] = {str(s): [] for s in args.src}
    for _ in range(args.rounds):
        for src in args.src:
            runs[str(src)].append(open_once(args.store, "bare", src))
    result = {"benchmark": "open_compare", "store": str(args.store), "rounds": args.rounds, "versions": {}}
    for src, rs in runs.items():
        result["versions"][src] = {
            "commit": commit_of(Path(src)),
            "open_s_best": min(r["open_s"] for r in rs),
            "open_s_median": statistics.median(r["open_s"] for r in rs),
            "ready_s_median": statistics.median(r["ready_s"] for r in rs),
            "rss_bytes_per_token_median": statistics.median(r["rss_bytes"] / max(1, r["stored_tokens"]) for r in rs),
            "runs": rs,
        }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    for src, v in result["versions"].items():
        print(f"{src}: open best {v['open_s_best']:.3f} s, median {v['open_s_median']:.3f} s; "
              f"ready median {v['ready_s_median']:.3f} s; {v['rss_bytes_per_token_median']:.2f} B/token")


if __name__ == "__main__":
    main()
