"""Memory tiers in front of the disk: device and host caches of blocks (IMPRESS section 3).

`manager.TierManager` is the entry point; `policies` holds the eviction policies (one
module each), `heaps` the per-(tier, class) min-heaps and `budget` the byte accounting
and victim planning. Nothing in this package imports torch or the rest of the store.
"""

from .heaps import DEVICE, HOST, TIERS
from ..errors import TierError
from .manager import DEFAULT_CLASS_SHARES, TierManager

__all__ = ["DEFAULT_CLASS_SHARES", "DEVICE", "HOST", "TIERS", "TierError", "TierManager"]
