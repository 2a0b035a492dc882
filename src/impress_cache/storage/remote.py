"""The interface of a remote object store, and the registry of its implementations.

A remote tier needs five operations on immutable objects named by strings: put a whole
object, get byte ranges of one (several ranges, issued concurrently), head (size or
absent), list by prefix (name, size, modification time) and delete. An implementation
is one module in this package plus one line in `BACKENDS` (keyed by URL scheme).
Every failure an implementation sees (unreachable server, timeout, missing object,
refused request) is raised as `RemoteError`, so the tier above can treat them alike:
recompute what it could not get, never fail a request.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ..errors import ImpressError


class RemoteError(ImpressError, IOError):
    """A remote object store could not serve a request (unreachable, slow, refused)."""


class RemoteMissing(RemoteError):
    """The object does not exist (any more)."""


class RemoteShort(RemoteError):
    """The object is shorter than the range asked for (truncated, or not what was expected)."""


@dataclass(frozen=True)
class RemoteEntry:
    """One listed object: its name below the tier's root, size and modification time (Unix s)."""

    name: str
    size: int
    mtime: float


class RemoteBackend(ABC):
    """Objects under one root (a bucket and a key prefix). Names are relative to it."""

    @abstractmethod
    def put(self, name: str, data: bytes | memoryview) -> None:
        """Store a whole object (visible to readers only once complete)."""

    @abstractmethod
    def get(self, name: str) -> bytes:
        """A whole object; `RemoteMissing` if absent."""

    @abstractmethod
    def get_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Byte ranges ``[start, end)`` of one object, fetched concurrently."""

    @abstractmethod
    def head(self, name: str) -> int | None:
        """Size of an object, or ``None`` if absent."""

    @abstractmethod
    def list(self, prefix: str) -> list[RemoteEntry]:
        """Every object whose name starts with ``prefix`` (a folder ending in ``/``)."""

    @abstractmethod
    def delete(self, names: Sequence[str]) -> None:
        """Remove objects (absent ones are ignored)."""

    def check(self) -> str | None:
        """Whether the remote can be used: ``None``, or what is wrong, naming the bucket
        and the endpoint (a missing bucket, refused credentials, an unreachable server).
        By default a listing of the root."""
        try:
            self.list("")
        except RemoteError as exc:
            return str(exc)
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections."""


#: URL scheme -> "module:class" of its implementation (imported on first use)
BACKENDS: dict[str, str] = {
    "s3": "impress_cache.storage.s3_remote:S3Backend",
}


def open_remote(url: str, options: Mapping[str, Any] | None = None) -> RemoteBackend:
    """The backend for ``url`` (``scheme://bucket/prefix``) with client ``options``."""
    parsed = urlparse(url)
    target = BACKENDS.get(parsed.scheme)
    if target is None:
        raise RemoteError(f"no remote backend for {url!r}; known schemes: {', '.join(sorted(BACKENDS))}")
    module, cls = target.split(":")
    try:
        impl = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise RemoteError(f"the {parsed.scheme} backend needs an optional dependency: pip install 'impress-cache[remote]' ({exc})") from exc
    return impl(parsed.netloc, parsed.path.strip("/"), dict(options or {}))
