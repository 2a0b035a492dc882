"""Hooks on a model: checks of what ``generate`` passes to an ImpressCache, and query capture.

Installed once per model (under a lock, so threads building their first caches on one
model install them exactly once) by the first `ImpressCache` built for it, and removed
with `remove_hooks`. Every hook returns at once unless the call carries an ImpressCache,
so a plain ``generate`` (another cache, ``inputs_embeds``, assisted decoding) runs as if
the hooks were not there:

* a forward pre-hook on the model checks that every forward runs the next expected
  tokens of the cache's prompt (`PromptGuard.check_forward`);
* a wrapper of ``prepare_inputs_for_generation`` (same signature, so ``generate``'s
  feature checks still see its parameters) shows the cache the whole prompt;
* on every attention module with a ``q_proj``, a pre-hook notes the rotary
  ``position_embeddings`` when a sparse prefill needs the layer's queries, and a forward
  hook on the module producing the queries (``q_norm`` where the architecture has one,
  else ``q_proj``) rotates its output and hands it to the cache. Nothing is recomputed.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .compat import cache_argument

_lock = threading.Lock()
_capture = threading.local()


@dataclass
class _Installed:
    handles: list[Any] = field(default_factory=list)
    prepare: Callable[..., Any] | None = None


_installed: "weakref.WeakKeyDictionary[torch.nn.Module, _Installed]" = weakref.WeakKeyDictionary()


def hooks_installed(model: torch.nn.Module) -> bool:
    """Whether `install_hooks` has run on ``model`` (and `remove_hooks` has not)."""
    with _lock:
        return model in _installed


def install_hooks(model: torch.nn.Module, cache_type: type) -> None:
    """Install the hooks on ``model`` unless they are there already (thread-safe)."""
    with _lock:
        if model in _installed:
            return
        done = _Installed()
        done.handles.append(model.register_forward_pre_hook(_model_pre_hook(cache_type), with_kwargs=True))
        done.handles.extend(_install_query_capture(model, cache_type))
        original = model.prepare_inputs_for_generation

        @functools.wraps(original)
        def prepare_inputs_for_generation(*args: Any, **kwargs: Any) -> Any:
            cache = cache_argument(kwargs)
            if isinstance(cache, cache_type):
                ids = kwargs.get("input_ids", args[0] if args else None)
                cache.check_prompt(ids, kwargs.get("attention_mask"))
            return original(*args, **kwargs)

        model.prepare_inputs_for_generation = prepare_inputs_for_generation
        done.prepare = original
        _installed[model] = done


def remove_hooks(model: torch.nn.Module) -> bool:
    """Remove everything `install_hooks` put on ``model``; returns whether there was any.

    The next `ImpressCache` built for the model installs them again.
    """
    with _lock:
        done = _installed.pop(model, None)
        if done is None:
            return False
        for handle in done.handles:
            handle.remove()
        if "prepare_inputs_for_generation" in vars(model):
            del model.prepare_inputs_for_generation
        return True


def _model_pre_hook(cache_type: type) -> Callable[..., None]:
    def pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = cache_argument(kwargs)
        if isinstance(cache, cache_type):
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache.check_forward(ids, kwargs.get("attention_mask"))

    return pre_forward


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _install_query_capture(model: torch.nn.Module, cache_type: type) -> list[Any]:
    handles: list[Any] = []
    inner = getattr(model, "model", model)
    for layer in getattr(inner, "layers", []):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "q_proj"):
            continue
        source = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj

        def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            cache = cache_argument(kwargs)
            if isinstance(cache, cache_type) and cache.wants_queries:
                _capture.target = (cache, module.layer_idx, module.head_dim, kwargs.get("position_embeddings"))
            else:
                _capture.target = None

        def took(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            target = getattr(_capture, "target", None)
            if target is None:
                return
            cache, layer_idx, head_dim, rope = target
            _capture.target = None
            q = output.reshape(output.shape[0], output.shape[1], -1, head_dim).transpose(1, 2)
            if rope is not None:
                cos, sin = rope
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                q = q * cos + _rotate_half(q) * sin
            cache.capture_queries(layer_idx, q)

        handles.append(attn.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(source.register_forward_hook(took))
    return handles
