"""The persistent prefix store: `ImpressStore` and the rooms behind it (see `store.store`).

Nothing in this package imports transformers or the selection logic.
"""

from .blockset import BlockSet, ReadStats, invalid_io_ratio
from .catalog import CHUNK_DIR
from .leftovers import QUARANTINE_DIR
from .layout import PrefixLayout, Unit
from .leases import MATCH_GRACE_S, PrefixLease
from .store import INDEX_NAME, ImpressStore, LoadedPrefix

__all__ = [
    "BlockSet",
    "CHUNK_DIR",
    "ImpressStore",
    "INDEX_NAME",
    "LoadedPrefix",
    "MATCH_GRACE_S",
    "PrefixLayout",
    "PrefixLease",
    "QUARANTINE_DIR",
    "ReadStats",
    "Unit",
    "invalid_io_ratio",
]
