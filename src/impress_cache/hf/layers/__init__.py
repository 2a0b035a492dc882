"""One cache layer per model layer, chosen by what transformers says the layer is.

`LAYER_CLASSES` maps each kind of `model_info.LayerInfo` to the layer class an
`ImpressCache` builds for it; `transformers`' own `DummyLayer` stands for layers that
store nothing (they use another layer's K/V, or have no attention).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DummyLayer

from ...model_info import LayerInfo, ModelSpec
from .full import ImpressLayer
from .hybrid import ImpressHybridLayer
from .state import ImpressStateLayer
from .window import ImpressWindowLayer

LAYER_CLASSES: dict[str, type] = {
    "full": ImpressLayer, "window": ImpressWindowLayer, "shared": DummyLayer, "state": ImpressStateLayer,
    "hybrid": ImpressHybridLayer,
}


def make_layers(spec: ModelSpec) -> list[Any]:
    """The cache layers of one request, one per model layer."""
    out: list[Any] = []
    stored = {m: s for s, m in enumerate(spec.stored_layers)}
    for m, info in enumerate(spec.model_layers):
        cls = LAYER_CLASSES[info.kind]
        if info.kind == "shared":
            out.append(cls())
        elif info.kind == "state":
            out.append(cls(number_of_states=info.states))
        elif info.kind == "hybrid":
            out.append(cls(number_of_states=info.states, info=info, padded=spec.padded(stored[m])))
        else:
            out.append(cls(info=info, padded=spec.padded(stored[m])))
    return out


def state_tensors(spec: ModelSpec, layers: list[Any]) -> dict[str, torch.Tensor]:
    """Copies of the (one-row) batch's conv and recurrent states of every state layer
    (``L{layer}.conv{i}`` / ``L{layer}.rec{i}``), for a checkpoint."""
    row = 0
    out: dict[str, torch.Tensor] = {}
    for m in spec.state_layers:
        layer = layers[m]
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                out[f"L{m}.conv{i}"] = layer.conv_states[i][row : row + 1].detach().to("cpu", copy=True)
            if layer.is_recurrent_states_initialized[i]:
                out[f"L{m}.rec{i}"] = layer.recurrent_states[i][row : row + 1].detach().to("cpu", copy=True)
    return out


def restore_states(spec: ModelSpec, layers: list[Any], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put a checkpoint's states into the state layers: the next forward continues after
    the checkpoint's last token."""
    for m in spec.state_layers:
        layer = layers[m]
        for i in range(layer.number_of_states):
            conv, rec = tensors.get(f"L{m}.conv{i}"), tensors.get(f"L{m}.rec{i}")
            if conv is not None:
                conv = conv.to(device)
                layer.lazy_initialization(conv_states=conv, state_idx=i, conv_kernel_size=conv.shape[-1])
                layer.conv_states[i].copy_(conv)
            if rec is not None:
                layer.lazy_initialization(recurrent_states=rec.to(device), state_idx=i)
                layer.recurrent_states[i].copy_(rec.to(device))
            layer.has_previous_state[i] = conv is not None or rec is not None


def to_stored(spec: ModelSpec, info: LayerInfo, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., heads, rows, dim]`` keys and values of one layer, padded with zeros to the
    store's width (unchanged when the layer has it)."""
    h, d = spec.num_kv_heads, spec.head_dim
    if (info.k_heads, info.k_dim, info.v_heads, info.v_dim) == (h, d, h, d):
        return keys, values
    out = []
    for t in (keys, values):
        p = t.new_zeros((*t.shape[:-3], h, t.shape[-2], d))
        p[..., : t.shape[-3], :, : t.shape[-1]] = t
        out.append(p)
    return out[0], out[1]


__all__ = ["LAYER_CLASSES", "ImpressHybridLayer", "ImpressLayer", "ImpressStateLayer", "ImpressWindowLayer", "make_layers", "restore_states", "state_tensors", "to_stored"]
