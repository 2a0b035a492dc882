"""The full-attention layer of an ImpressCache: stored rows first, then the new tokens."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from ...errors import CacheUsageError
from ...model_info import LayerInfo


class ImpressLayer(DynamicLayer):
    """A dynamic cache layer that starts with stored prefix rows.

    Before its first ``update`` the layer only knows its prefix length; the request then
    hands it a buffer (`place`) holding its prefix rows plus room for the new tokens, so
    the first ``update`` copies only the new rows (no concatenation of the prefix).
    Buffers come in the store's padded width (``[2, batch, kv_heads, rows, head_dim]``);
    a layer whose own K or V is narrower (``info``) keeps only its part of them.
    ``is_croppable`` is True as for every dynamic layer: `crop` removes rows computed
    after the prefix exactly (it raises `CacheUsageError` instead of cutting into the
    reused prefix). Nothing here reads ``layer.dtype``, which 5.24 removed: rows take
    the dtype of the incoming keys.
    """

    is_croppable = True

    def __init__(self, prefix_len: int = 0, hidden: int = 0, info: LayerInfo | None = None, padded: bool = False) -> None:
        super().__init__()
        #: ``([2, batch, kv_heads, held + room, head_dim], held)`` until the first update
        self._buffer: tuple[torch.Tensor, int] | None = None
        self.info = info
        #: the store keeps this layer wider than its own K or V
        self.padded = padded
        self.start_with(prefix_len, hidden)

    def start_with(self, prefix_len: int, hidden: int = 0) -> None:
        """Set how many prefix rows this layer starts with (before any update);
        ``hidden`` of them are not held (sparse prefill, or rows a window no longer
        sees): key index j is position j + hidden."""
        if self.is_initialized:
            raise CacheUsageError("an ImpressLayer gets its prefix rows before its first update")
        self._prefix_len = prefix_len
        self.hidden = hidden

    @property
    def prefix_len(self) -> int:
        return self._prefix_len

    def own(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's part of padded ``[..., kv_heads, rows, head_dim]`` keys and values."""
        if not self.padded or self.info is None:
            return keys, values
        i = self.info
        return keys[..., : i.k_heads, :, : i.k_dim], values[..., : i.v_heads, :, : i.v_dim]

    def place(self, buf: torch.Tensor, held: int) -> None:
        """The prefix rows to start with (``buf[:, :, :, :held]``)."""
        self._buffer = (buf, held)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized and self._buffer is not None and not self.padded:
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
            k, v = self.own(buf[0, :, :, :held], buf[1, :, :, :held])
            self.keys = k.to(key_states.device, key_states.dtype)
            self.values = v.to(value_states.device, value_states.dtype)
        self._buffer = None

    def get_seq_length(self) -> int:
        """Logical length: prefix plus everything after it, held or not."""
        if not self.is_initialized:
            return self._prefix_len
        return super().get_seq_length() + self.hidden

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() - self.hidden + query_length, self.hidden

    def restore_prefix(
        self,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        new: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Replace the held prefix rows by the whole prefix (``decode="full"``; ``keys``
        None keeps the held rows) and, with ``new``, the rows after it by those keys and
        values (the new tokens recomputed against the whole prefix)."""
        held = self._prefix_len - self.hidden
        dev, dt = self.keys.device, self.keys.dtype
        if keys is not None and values is not None:
            k, v = self.own(keys, values)
            ks, vs = [k.to(dev, dt)], [v.to(dev, dt)]
            hidden = 0
        else:
            ks, vs = [self.keys[:, :, :held]], [self.values[:, :, :held]]
            hidden = self.hidden
        after = held
        if new is not None:
            ks.append(new[0].to(dev, dt))
            vs.append(new[1].to(dev, dt))
            after += new[0].shape[-2]
        self.keys = torch.cat([*ks, self.keys[:, :, after:]], dim=-2)
        self.values = torch.cat([*vs, self.values[:, :, after:]], dim=-2)
        self.hidden = hidden

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.get_seq_length() + tokens_to_remove < self._prefix_len:
            raise CacheUsageError("crop() would cut into the reused prefix; ImpressCache does not support that")
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            super().batch_select_indices(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder the held rows (rows not placed yet follow the request's
        row map)."""
        if self.is_initialized and self.keys.numel() > 0:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))
