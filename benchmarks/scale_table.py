"""The table of docs/operating.md ("Scale benchmark") from a result of `scale.py`.

    python benchmarks/scale_table.py results/scale.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

Row = tuple[str, Callable[[dict[str, Any]], str]]


def _pair(fmt: str, a: float, b: float) -> str:
    return f"{a:{fmt}} / {b:{fmt}}"


ROWS: list[Row] = [
    ("stored prompts", lambda r: f"{r['prompts']:,}"),
    ("stored distinct tokens", lambda r: f"{r['stored_tokens']:,}"),
    ("writes below budget (prompts/s, median window)", lambda r: f"{r['below']['write_prompts_per_s']:.1f}"),
    ("writes at budget (prompts/s, median window)", lambda r: f"{r['at']['write_prompts_per_s']:.1f}"),
    ("at / below (median of the pairs of windows)", lambda r: f"{r['throughput_ratio']:.2f}"),
    ("at / below (all writes over their time)", lambda r: f"{r['throughput_ratio_total']:.2f}"),
    ("CPU per write below / at (ms; writer and unlink threads)",
     lambda r: _pair(".2f", r["below"]["cpu_ms_per_write"], r["at"]["cpu_ms_per_write"])),
    ("CPU below / at", lambda r: f"{r['cpu_ratio']:.2f}"),
    ("eviction per write, mean / p99 (ms)", lambda r: _pair(".2f", r["at"]["eviction_ms_mean"], r["at"]["eviction_ms_p99"])),
    ("ImpressCache construction p50 below / at (ms)",
     lambda r: _pair(".2f", r["below"]["construct_ms_p50"], r["at"]["construct_ms_p50"])),
    ("ImpressCache construction p99 below / at (ms)",
     lambda r: _pair(".1f", r["below"]["construct_ms_p99"], r["at"]["construct_ms_p99"])),
    ("p99 at / below", lambda r: f"{r['construct_p99_ratio']:.2f}"),
    ("generate p50 below / at (ms)", lambda r: _pair(".1f", r["below"]["generate_ms_p50"], r["at"]["generate_ms_p50"])),
    ("match p50 / p99 (µs)", lambda r: _pair(".1f", r["match_us_p50"], r["match_us_p99"])),
    ("open (s, best of 3 / median)", lambda r: _pair(".3f", r["open_s"], r["open_s_median"])),
    ("open and deferred jobs done (s, median)", lambda r: f"{r['ready_s_median']:.3f}"),
    ("resident memory after open (MiB)", lambda r: f"{r['rss_bytes'] / 2**20:.1f}"),
    ("per stored token (bytes; median of 3)", lambda r: f"{r['rss_bytes_per_token']:.2f} ({r.get('rss_bytes_per_token_median', float('nan')):.2f})"),
    ("per stored token with memory tiers (bytes)", lambda r: f"{r['rss_bytes_per_token_tiers']:.1f}"),
    ("footprint: du / raw K/V", lambda r: f"{r['footprint_ratio']:.2f}"),
]


def table(result: dict[str, Any]) -> str:
    rows = result["sizes"]
    lines = ["| " + " | ".join([ROWS[0][0], *(ROWS[0][1](r) for r in rows)]) + " |", "|---" * (len(rows) + 1) + "|"]
    lines += ["| " + " | ".join([name, *(cell(r) for r in rows)]) + " |" for name, cell in ROWS[1:]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path)
    print(table(json.loads(ap.parse_args().result.read_text())))


if __name__ == "__main__":
    main()
