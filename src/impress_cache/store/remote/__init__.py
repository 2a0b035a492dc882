"""The remote tier: chunk files shared between hosts through an object store."""

from .objects import BadObject, namespace
from .tier import RemoteTier

__all__ = ["BadObject", "RemoteTier", "namespace"]
