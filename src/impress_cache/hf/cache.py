"""ImpressCache: one request's view of an `ImpressStore`, as a transformers cache.

This module only speaks the transformers cache protocol; the plan of the request lives
in `request`, the sparse prefill in `sparse`, the hooks in `hooks` and the checks in
`guards`:

* ``generate`` computes only ``input_ids.shape[1] - cache.get_seq_length()`` tokens, so
  before the first forward every layer reports the reused prefix length;
* on its first ``update`` a layer puts the stored prefix rows in front of the new ones;
* once the last layer has seen the whole prompt, the prompt's K/V go to the store's
  background writer (dense reuse) or the rest of the prefix is fetched (sparse reuse
  with ``decode="full"``).

Left padding: each row reuses the same number of columns ``C`` (the cache holds one
sequence length), ``C = min_i(pad_i + match_i)``; padding columns hold zeros, which the
attention mask hides.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..errors import CacheUsageError
from ..stats import RequestStats
from ..store.store import ImpressStore
from .guards import PromptGuard, check_inputs
from .hooks import install_hooks
from .request import PrefixRequest


class ImpressLayer(DynamicLayer):
    """A dynamic cache layer that starts with stored prefix rows.

    Before its first ``update`` the layer only knows its prefix length; the request then
    hands it a buffer (`place`) holding its prefix rows plus room for the new tokens, so
    the first ``update`` copies only the new rows (no concatenation of the prefix).
    """

    def __init__(self, prefix_len: int, hidden: int = 0) -> None:
        super().__init__()
        self._prefix_len = prefix_len
        #: ``([2, batch, kv_heads, held + room, head_dim], held)`` until the first update
        self._buffer: tuple[torch.Tensor, int] | None = None
        #: prefix rows that are not held (sparse prefill): key index j is position j + hidden
        self.hidden = hidden

    def place(self, buf: torch.Tensor, held: int) -> None:
        """The prefix rows to start with (``buf[:, :, :, :held]``)."""
        self._buffer = (buf, held)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized and self._buffer is not None:
            buf, held = self._buffer
            n = key_states.shape[-2]
            if (
                buf.shape[3] == held + n
                and buf.shape[1] == key_states.shape[0]
                and buf.device == key_states.device
                and buf.dtype == key_states.dtype == value_states.dtype
            ):
                self._buffer = None
                super().lazy_initialization(key_states, value_states)
                buf[0, :, :, held:].copy_(key_states)
                buf[1, :, :, held:].copy_(value_states)
                self.keys, self.values = buf[0], buf[1]
                return self.keys, self.values
        return super().update(key_states, value_states, *args, **kwargs)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self._buffer is not None:  # the buffer's room does not fit: start from its prefix rows
            buf, held = self._buffer
            self.keys = buf[0, :, :, :held].to(key_states.device, key_states.dtype)
            self.values = buf[1, :, :, :held].to(value_states.device, value_states.dtype)
        self._buffer = None

    def get_seq_length(self) -> int:
        """Logical length: prefix plus everything after it, held or not."""
        if not self.is_initialized:
            return self._prefix_len
        return super().get_seq_length() + self.hidden

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() - self.hidden + query_length, self.hidden

    def restore_prefix(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the held prefix rows by the whole prefix (``decode="full"``)."""
        held = self._prefix_len - self.hidden
        self.keys = torch.cat([keys.to(self.keys.device, self.keys.dtype), self.keys[:, :, held:]], dim=-2)
        self.values = torch.cat([values.to(self.values.device, self.values.dtype), self.values[:, :, held:]], dim=-2)
        self.hidden = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.get_seq_length() + tokens_to_remove < self._prefix_len:
            raise CacheUsageError("crop() would cut into the reused prefix; ImpressCache does not support that")
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            raise CacheUsageError("ImpressCache cannot select batch rows before the prefill")
        super().batch_select_indices(indices)


class ImpressCache(Cache):
    """A ``transformers`` cache that reuses the longest stored prefix of each prompt.

    Parameters
    ----------
    store:
        The `ImpressStore` to read from and write to.
    input_ids:
        The full prompt, ``[batch, seq]`` integer tensor, exactly as passed to
        ``generate``. Each row reuses at most ``seq - 1`` stored tokens.
    attention_mask:
        The mask passed to ``generate`` (left padding only). Required when the batch
        is padded.
    store_prompt:
        Write the prompt's K/V to the store once it has been computed.

    Notes
    -----
    One cache serves one request: build a new one for every ``generate`` call.
    """

    def __init__(
        self,
        store: ImpressStore,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        store_prompt: bool = True,
    ) -> None:
        if not isinstance(store, ImpressStore):
            raise TypeError(f"store must be an ImpressStore, got {type(store).__name__}")
        ids, mask = check_inputs(input_ids, attention_mask, store.spec.vocab_size)
        self.store = store
        self.store_prompt = store_prompt
        self._request = PrefixRequest(store, ids, mask)
        self._guard = PromptGuard(self._request)
        self._written = False
        req = self._request
        hidden = req.reused - req.sparse.k if req.sparse is not None else 0
        super().__init__(layers=[ImpressLayer(req.reused, hidden) for _ in range(store.spec.num_layers)])
        install_hooks(store.model, ImpressCache)

    # -- what users read ---------------------------------------------------------------
    @property
    def stats(self) -> RequestStats:
        """What this request reused, computed, read and wrote (see `RequestStats`)."""
        return self._request.stats

    @property
    def reused_tokens(self) -> int:
        """Columns of the prompt served from the store (the same for every row)."""
        return self._request.reused

    @property
    def selections(self) -> dict[int, dict[int, torch.Tensor]]:
        """Sparse prefill: ``selections[layer][batch_row]`` = prefix positions attended
        (relative to the row's first real token; ``[k]`` shared or ``[kv_heads, k]``)."""
        sparse = self._request.sparse
        return {} if sparse is None else sparse.selections

    # -- called by the hooks -------------------------------------------------------------
    @property
    def wants_queries(self) -> bool:
        """True while a sparse prefill still needs the new tokens' queries."""
        return self._request.sparse is not None and not self._written

    def capture_queries(self, layer_idx: int, queries: torch.Tensor) -> None:
        """Receive ``[batch, q_heads, n, head_dim]`` post-RoPE queries of one layer."""
        sparse = self._request.sparse
        if sparse is not None and not self.layers[layer_idx].is_initialized:
            sparse.capture(layer_idx, queries)

    def check_prompt(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        """``generate`` shows the whole prompt (the forward only sees the tokens after the
        reused prefix): it must be the one the cache was built for."""
        self._guard.check_prompt(input_ids, attention_mask, self.expand)

    def check_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        """Before every model forward that uses this cache."""
        if self._request.prefill_started is None:
            self._request.prefill_started = time.perf_counter()
        if self._guard.check_forward(input_ids, attention_mask, self.expand) and self._request.full_pending:
            keys, values = self._request.take_full_prefix()
            for i, layer in enumerate(self.layers):
                layer.restore_prefix(keys[i], values[i])

    # -- the cache protocol --------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        req = self._request
        if not layer.is_initialized and req.reused > 0:
            layer.place(*req.prefix_for(layer_idx, key_states))
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if (
            not self._written
            and layer_idx == len(self.layers) - 1
            and layer.get_seq_length() >= self._guard.ids.shape[1]
        ):
            self._written = True
            req.finish_prefill([la.keys for la in self.layers], [la.values for la in self.layers], self.store_prompt)
        return keys, values

    def expand(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (for ``num_return_sequences`` or beams)."""
        self.batch_repeat_interleave(repeats)
        self._request.expand(repeats)
