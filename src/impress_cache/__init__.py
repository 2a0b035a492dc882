"""impress_cache: a disk-backed prefix KV cache for Hugging Face models (IMPRESS, FAST 2025).

>>> from impress_cache import ImpressConfig, ImpressStore, ImpressCache
"""

from __future__ import annotations

from .config import ImpressConfig
from .errors import (
    CacheUsageError,
    ConfigError,
    CorruptBlockError,
    ImpressError,
    ModelMismatchError,
    ReadOnlyStoreError,
    StoreFormatError,
    StoreIOError,
    StoreLimitError,
    TierError,
    UnsupportedModelError,
)
from .hf.cache import ImpressCache
from .hf.hooks import remove_hooks
from .model_info import LAYER_KINDS
from .stats import RequestStats
from .store import ImpressStore

__version__ = "0.1.0"

__all__ = [
    "CacheUsageError",
    "ConfigError",
    "CorruptBlockError",
    "ImpressCache",
    "ImpressConfig",
    "ImpressError",
    "ImpressStore",
    "ModelMismatchError",
    "ReadOnlyStoreError",
    "StoreFormatError",
    "StoreIOError",
    "StoreLimitError",
    "RequestStats",
    "LAYER_KINDS",
    "TierError",
    "UnsupportedModelError",
    "__version__",
    "remove_hooks",
]
