"""Namespaces: a request matches only the prefixes stored under its own namespace.

The tree does not key a prompt stored under a namespace by its tokens but by its *key*:
the tokens with the first one replaced by a negative pseudo id (real token ids are never
negative) that encodes the namespace and that first token,
``-1 - ((ns - 1) * vocab_size + token)``, where ``ns`` is the namespace's id in the index
(table ``namespaces``: an id is handed out once, for the SHA-256 of the name; the name
itself is written nowhere). Every row keeps the K/V of the real token at its position:
only the label of the first row changes. So prompts of two namespaces never share a
node (their keys differ from the first token on), nor with the default namespace
(``None``: the key is the tokens themselves, as before namespaces existed: stores,
file names and state checkpoints of the default namespace are unchanged).

The key is what a chunk file's header, the index and a state checkpoint's name record
for such a prompt. A repaired index keeps the namespaces' ids (`repair`); files of a
namespace whose id is lost are quarantined, never given to another namespace. The remote
tier only carries the default namespace (ids are handed out per store).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import StoreLimitError
from ..index.radix import as_tokens

#: the longest namespace accepted, in characters
MAX_NAMESPACE_CHARS = 1024


def check_namespace(namespace: Any) -> str | None:
    """``namespace`` if it is one (``None``, or a string of 1 to `MAX_NAMESPACE_CHARS`
    characters); `TypeError` or `ValueError` saying what is wrong otherwise."""
    if namespace is None:
        return None
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a string or None (the default namespace), got {type(namespace).__name__}")
    if not namespace:
        raise ValueError("namespace must be a non-empty string; None is the default namespace")
    if len(namespace) > MAX_NAMESPACE_CHARS:
        raise ValueError(f"namespace must be at most {MAX_NAMESPACE_CHARS} characters long, got {len(namespace)}")
    return namespace


def digest_of(namespace: str) -> str:
    """What the index records of a namespace (its SHA-256, hex)."""
    return hashlib.sha256(namespace.encode("utf-8", "surrogatepass")).hexdigest()


def namespaced(tokens: Sequence[int] | np.ndarray) -> bool:
    """Whether a key (a stored sequence) belongs to a namespace, not to the default one."""
    return len(tokens) > 0 and int(tokens[0]) < 0


def namespace_of(key0: int, vocab_size: int) -> int:
    """The namespace id a key's first (pseudo) id encodes."""
    return (-1 - int(key0)) // vocab_size + 1


class Namespaces:
    """The keys of one store's namespaces (ids cached once known; thread-safe)."""

    def __init__(self, index: Any, vocab_size: int, read_only: bool) -> None:
        self._index = index
        self._vocab = int(vocab_size)
        self._read_only = read_only
        #: every namespace the index names when the store opens (a lookup then never
        #: depends on the index being free), and those found or given ids since
        self._ids: dict[str, int] = {digest: ns for ns, digest in index.namespaces().items()}
        self._lock = threading.Lock()

    @property
    def limit(self) -> int:
        """Namespaces a store can hold (the pseudo ids must fit in 32 bits)."""
        return (1 << 31) // self._vocab

    def key(self, tokens: Sequence[int] | np.ndarray, namespace: str | None, create: bool = False) -> np.ndarray | None:
        """The sequence the tree keeps ``tokens`` under in ``namespace`` (the tokens
        themselves for ``None``); ``None`` when nothing was ever stored under that
        namespace (unless ``create``: it then gets its id)."""
        arr = as_tokens(tokens)
        if check_namespace(namespace) is None or not len(arr):
            return arr
        first = int(arr[0])
        if not 0 <= first < self._vocab:
            raise ValueError(f"token ids must lie in [0, {self._vocab}) under a namespace, got {first} first")
        ns = self._id(namespace, create)  # type: ignore[arg-type]
        if ns is None:
            return None
        out = arr.copy()
        out[0] = -1 - ((ns - 1) * self._vocab + first)
        return out

    def _id(self, namespace: str, create: bool) -> int | None:
        digest = digest_of(namespace)
        with self._lock:
            ns = self._ids.get(digest)
        if ns is not None:
            return ns
        # a lookup does not wait for a write's commit: a namespace unknown when the store
        # opened and never stored under by this process matches nothing while the index
        # is busy (prompts another process stored under it since are matched later)
        ns = self._index.namespace_id(digest, create=create and not self._read_only, wait=create)
        if ns is None:
            return None
        if ns > self.limit:
            raise StoreLimitError(
                f"this store holds at most {self.limit} namespaces (for a vocabulary of {self._vocab} tokens); "
                "use another store directory for more"
            )
        with self._lock:
            self._ids[digest] = ns
        return ns
