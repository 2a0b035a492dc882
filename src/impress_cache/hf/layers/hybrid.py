"""A layer that keeps a recurrent state and K/V in one (Falcon-H1's Mamba + attention).

The K/V part is an `ImpressLayer` (stored rows first, then the new tokens); the state
part is transformers' `LinearAttentionLayer` (`ImpressStateLayer`), restored from the store's checkpoint like a
pure state layer. Built the way transformers builds its own
`LinearAttentionAndFullAttentionLayer`: each call goes to the part it is meant for.
"""

from __future__ import annotations

from typing import Any

import torch
from ...model_info import LayerInfo
from .full import ImpressLayer
from .state import ImpressStateLayer as LinearAttentionLayer


class ImpressHybridLayer(LinearAttentionLayer, ImpressLayer):
    """Stored K/V rows plus a checkpointed recurrent state."""

    is_compileable = False

    def __init__(self, number_of_states: int = 1, info: LayerInfo | None = None, padded: bool = False) -> None:
        ImpressLayer.__init__(self, info=info, padded=padded)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        if len(args) == 2 and not kwargs:  # the K/V part's first update
            ImpressLayer.lazy_initialization(self, *args)
        elif not args and kwargs:  # a conv or recurrent state
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def batch_repeat_interleave(self, repeats: int) -> None:
        LinearAttentionLayer.batch_repeat_interleave(self, repeats)
        ImpressLayer.batch_repeat_interleave(self, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        LinearAttentionLayer.batch_select_indices(self, indices)
        ImpressLayer.batch_select_indices(self, indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        ImpressLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        ImpressLayer.crop(self, tokens_to_remove)

    def offload(self) -> None:
        ImpressLayer.offload(self)
        LinearAttentionLayer.offload(self)

    def prefetch(self) -> None:
        ImpressLayer.prefetch(self)
        LinearAttentionLayer.prefetch(self)
