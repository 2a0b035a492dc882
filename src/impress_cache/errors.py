"""Exceptions raised by impress_cache. All derive from `ImpressError`."""

from __future__ import annotations


class ImpressError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(ImpressError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class ModelMismatchError(ImpressError, ValueError):
    """A store was opened with a model other than the one it was built for."""


class UnsupportedModelError(ImpressError, ValueError):
    """The model's architecture is not one this library knows how to serve."""


class CacheUsageError(ImpressError, ValueError):
    """An `ImpressCache` was used in a way it does not support."""


class StoreFormatError(ImpressError):
    """A store's index or files are not in a format or state this version can read
    (another schema version, a damaged index); the message names the file and what to do."""


class IndexRefusedError(ImpressError):
    """The index refused a change that would break one of its invariants (a node whose
    rows are not inside an indexed file, a node whose parent is missing, a file removed
    while a node still references it): the change was planned from a state another
    thread or process changed meanwhile. Nothing was committed; the index is intact (not
    damaged) and the store keeps serving."""


class StoreLimitError(ImpressError, ValueError):
    """A file, layer or block number beyond what the store addresses (`storage.base.block_code`:
    4,096 layers, 1,048,576 blocks per layer of one file, 2^31 file ids)."""


class TierError(ImpressError, ValueError):
    """The memory tiers (`tiers.TierManager`) were called with an invalid argument (an
    unknown tier name, a negative byte count)."""


class CorruptBlockError(ImpressError, IOError):
    """A stored block is missing, truncated or fails its checksum."""

    def __init__(self, message: str, file_id: int) -> None:
        super().__init__(message)
        self.file_id = file_id


class StoreIOError(ImpressError, OSError):
    """The store cannot read or write its directory (disk full, an I/O error, no
    permission, a read-only volume); the message names the path and what to do."""


class ReadOnlyStoreError(StoreIOError):
    """A store on a read-only path was opened for writing; open it with
    ``ImpressStore(path, model, config, read_only=True)``."""
