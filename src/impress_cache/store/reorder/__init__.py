"""Importance reordering: per-node statistics of which rows requests need, and the
reorganiser that rewrites nodes so that those rows share the first blocks."""

from .importance import ImportanceStats, NodeImportance
from .reorganizer import LOCK_NAME, Plan, ReorgCounters, Reorganizer, block_shares, top_blocks

__all__ = [
    "ImportanceStats", "NodeImportance", "LOCK_NAME", "Plan", "ReorgCounters", "Reorganizer", "block_shares", "top_blocks",
]
