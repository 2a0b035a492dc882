"""Layers that keep a recurrent state (linear attention, SSM, short convolutions).

transformers' `LinearAttentionLayer` holds the state; a request restores it from the
store's checkpoint (`restore_states`). This subclass adds what ``generate`` asks of every
layer when it repeats or selects batch rows (beams, ``num_return_sequences``): the
restored states are repeated or selected with the rows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer


class ImpressStateLayer(LinearAttentionLayer):
    """A `LinearAttentionLayer` whose states follow batch repeats and selections."""

    def _each_state(self, fn) -> None:  # type: ignore[no-untyped-def]
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = fn(self.conv_states[i])
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = fn(self.recurrent_states[i])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._each_state(lambda t: t[indices.to(t.device)])
