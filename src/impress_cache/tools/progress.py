"""Progress bars for long prefills (``tqdm`` over decoder layers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


@contextmanager
def prefill_progress(model: torch.nn.Module, min_tokens: int = 256, desc: str = "prefill") -> Iterator[None]:
    """Show a bar advancing layer by layer for every forward of at least ``min_tokens`` tokens.

    Decode steps (one token) and short prompts show nothing.
    """
    layers = _decoder_layers(model)
    state: dict[str, tqdm | None] = {"bar": None}

    def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if module is layers[0] and hidden is not None and hidden.shape[1] >= min_tokens:
            state["bar"] = tqdm(total=len(layers), desc=f"{desc} {hidden.shape[1]} tokens", unit="layer", leave=False)

    def after(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        bar = state["bar"]
        if bar is not None:
            bar.update(1)
            if module is layers[-1]:
                bar.close()
                state["bar"] = None

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(layer.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if state["bar"] is not None:
            state["bar"].close()
