"""The remote tier: chunk files shared between hosts through an object store."""

from __future__ import annotations

from typing import Any

from .objects import BadObject, namespace
from .tier import RemoteTier


class NoRemote:
    """What a store without ``config.remote`` has in the remote tier's place: nothing to do."""

    files = None

    def pull(self, tokens: Any, limit: int | None) -> int:
        return 0

    def push(self, leaf: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def quarantined(self, record: Any) -> None:
        pass

    def stats(self) -> None:
        return None


__all__ = ["BadObject", "NoRemote", "RemoteTier", "namespace"]
