"""impress_cache: a disk-backed prefix KV cache for Hugging Face models (IMPRESS, FAST 2025).

>>> from impress_cache import ImpressConfig, ImpressStore, ImpressCache
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from .model_info import LAYER_KINDS
from .stats import RequestStats
from .store import ImpressStore

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .hf.cache import ImpressCache
    from .hf.hooks import remove_hooks

#: names that import transformers: loaded on first use, so that a process that only opens
#: stores (the CLI, another process writing a store) starts without transformers (~2 s)
_FROM_HF = {"ImpressCache": "cache", "remove_hooks": "hooks"}


def __getattr__(name: str) -> Any:
    if name in _FROM_HF:
        value = getattr(importlib.import_module(f".hf.{_FROM_HF[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_HF})  # the names loaded on first use too (completion, help)

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
