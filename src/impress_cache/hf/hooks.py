"""Hooks on a model: binding and checks of what ``generate`` passes to an ImpressCache, and
query capture.

Installed once per model (under a lock, so threads building their first caches on one
model install them exactly once) by the first `ImpressCache` built for it, and removed
with `remove_hooks`. Every hook returns at once unless the call carries an ImpressCache
(under either name, ``cache`` or ``past_key_values``), so a plain ``generate`` (another
cache, ``inputs_embeds``, assisted decoding) runs as if the hooks were not there:

* a wrapper of ``generate`` (same signature) binds an unbound cache to the prompt and
  mask ``generate`` received, before ``generate`` asks the cache its length, and
  refuses a cache that already served a request and the generation features a stored
  prefix cannot serve (`compat.unsupported_generation`);
* a wrapper of ``prepare_inputs_for_generation`` (same signature, so ``generate``'s
  feature checks still see its parameters) shows the cache the whole prompt. When the
  cache is still unbound there, ``generate`` was looked up before the hooks existed:
  ``model.generate(..., cache=ImpressCache(store))`` as the first call for a model
  evaluates ``model.generate`` before it builds the cache. The wrapper then binds the
  cache to the prompt of the prefill and tells ``generate`` to run only the tokens
  after the reused prefix (``next_sequence_length``, which both 5.23 and 5.24 pass);
* a forward pre-hook on the model checks that every forward runs the next expected
  tokens of the cache's prompt (`PromptGuard.check_forward`), and binds an unbound
  cache to a plain forward's input; a forward hook hands the output to the cache (the
  uncertainty guard may replace the prefill's last logits);
* on every attention module with a ``q_proj``, a pre-hook notes the rotary
  ``position_embeddings`` when a sparse prefill needs the layer's queries, and a forward
  hook on the module producing the queries (``q_norm`` where the architecture has one,
  else ``q_proj``) rotates its output (as the attention does: not in layers without
  position embeddings) and hands it to the cache. Nothing is recomputed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CacheUsageError
from .compat import cache_argument, generate_attention_mask, unsupported_generation

log = logging.getLogger(__name__)
_lock = threading.Lock()
_capture = threading.local()


@dataclass
class _Installed:
    handles: list[Any] = field(default_factory=list)
    #: instance attributes that wrap the class's methods (deleted on removal)
    wrapped: list[str] = field(default_factory=list)


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
        done.handles.append(model.register_forward_hook(_model_post_hook(cache_type), with_kwargs=True))
        done.handles.extend(_install_query_capture(model, cache_type))
        model.prepare_inputs_for_generation = _prepare_wrapper(model.prepare_inputs_for_generation, cache_type)
        model.generate = _generate_wrapper(model, model.generate, cache_type)
        done.wrapped = ["prepare_inputs_for_generation", "generate"]
        _installed[model] = done


def remove_hooks(model: torch.nn.Module) -> bool:
    """Remove everything `install_hooks` put on ``model``; returns whether there was any.

    The forward hooks go, and ``model.generate`` and ``model.prepare_inputs_for_generation``
    are the class's methods again. The next `ImpressCache` built for the model installs
    the hooks again; a cache built before the removal and not yet bound can no longer
    bind (using it raises `CacheUsageError`).
    """
    with _lock:
        done = _installed.pop(model, None)
        if done is None:
            return False
        for handle in done.handles:
            handle.remove()
        for name in done.wrapped:
            if name in vars(model):
                delattr(model, name)
        return True


def _generate_wrapper(model: torch.nn.Module, original: Callable[..., Any], cache_type: type) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        cache = cache_argument(kwargs)
        if not isinstance(cache, cache_type):
            return original(*args, **kwargs)
        check_model(model, cache)
        _begin_generate(model, cache, args, kwargs)
        try:
            out = original(*args, **kwargs)
        except BaseException:
            cache.end_generate(completed=False)
            raise
        cache.end_generate()
        return out

    return generate


def check_model(model: torch.nn.Module | None, cache: Any) -> None:
    """An ImpressCache serves only the model its store was opened with: K/V computed
    by another model (other weights, even of the same shape) would give wrong output."""
    if model is not None and cache.store.model is not model:
        raise CacheUsageError(
            f"this ImpressCache belongs to the store at {cache.store.path}, opened with another model "
            f"({type(cache.store.model).__name__} at {id(cache.store.model):#x}); its K/V cannot serve "
            f"{type(model).__name__} at {id(model):#x}. Open a store for this model and build the cache on it"
        )


def _begin_generate(model: torch.nn.Module, cache: Any, args: tuple, kwargs: dict) -> None:
    """Refuse what a stored prefix cannot serve; bind the cache to the prompt."""
    feature = unsupported_generation(model, kwargs)
    if feature is not None:
        raise CacheUsageError(f"{feature} is not supported with an ImpressCache. Generate without it, or without the ImpressCache")
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if ids is None:
        raise CacheUsageError("ImpressCache needs input_ids; inputs_embeds alone are not supported")
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = generate_attention_mask(ids, kwargs.get("generation_config") or model.generation_config, kwargs)
    cache.begin_generate(ids, mask)


def _prepare_wrapper(original: Callable[..., Any], cache_type: type) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_inputs_for_generation(*args: Any, **kwargs: Any) -> Any:
        cache = cache_argument(kwargs)
        if isinstance(cache, cache_type):
            check_model(getattr(original, "__self__", None), cache)
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not cache.is_bound:
                kwargs = _bind_in_prefill(cache, ids, kwargs)
            cache.check_prompt(ids, kwargs.get("attention_mask"))
        return original(*args, **kwargs)

    return prepare_inputs_for_generation


def _bind_in_prefill(cache: Any, ids: Any, kwargs: dict) -> dict:
    """``generate`` did not go through its wrapper and asked the unbound cache its length
    (0): bind now, and run only the tokens after the reused prefix."""
    if kwargs.get("inputs_embeds") is not None:
        raise CacheUsageError("ImpressCache needs input_ids; inputs_embeds alone are not supported")
    n = kwargs.get("next_sequence_length")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and kwargs.get("is_first_iteration") and n == ids.shape[1]):
        raise CacheUsageError(
            "generate did not show this unbound ImpressCache its whole prompt in one prefill step (assisted decoding, "
            "chunked prefill and continuing from cached inputs are not supported); build the cache with "
            "ImpressCache(store, input_ids, attention_mask=...) to get the check that fails"
        )
    cache.bind(ids, kwargs.get("attention_mask"))
    return {**kwargs, "next_sequence_length": ids.shape[1] - cache.reused_tokens}


def _model_pre_hook(cache_type: type) -> Callable[..., None]:
    def pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = cache_argument(kwargs)
        if isinstance(cache, cache_type):
            check_model(module, cache)
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache.check_forward(ids, kwargs.get("attention_mask"))

    return pre_forward


def _model_post_hook(cache_type: type) -> Callable[..., None]:
    def post_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        cache = cache_argument(kwargs)
        if isinstance(cache, cache_type):
            cache.after_forward(output)

    return post_forward


def _rotate(attn: torch.nn.Module, q: torch.Tensor, rope: Any) -> torch.Tensor:
    """``[batch, heads, n, head_dim]`` queries rotated as the attention module rotates them:
    with its modeling module's own ``apply_rotary_pos_emb(q, k, cos, sin)`` (partial and
    interleaved rotations included), else the usual rotate-half form."""
    cos, sin = rope
    fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if fn is not None:
        params = list(inspect.signature(fn).parameters)
        if params[:2] == ["q", "k"]:
            return fn(q, q, cos, sin)[0]
        if params[:1] == ["x"] and "unsqueeze_dim" in params:  # one tensor at a time (Gemma 4)
            return fn(q, cos, sin, unsqueeze_dim=1)
    half = q.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin


#: families whose attention rotates the queries in some layers only (their ``forward``
#: calls ``apply_rotary_pos_emb`` under these conditions; the others' layers take no
#: position embeddings: global layers, NoPE); `_rotates`
_ROTATES_IF: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(
        ("exaone4", "exaone4_5", "exaone_moe", "kolibri1"),
        lambda a: getattr(a, "sliding_window", None) is None or bool(getattr(a, "is_sliding", False)),
    ),
    **dict.fromkeys(("cohere2", "flint"), lambda a: getattr(a, "sliding_window", None) is not None),
    "cohere2_moe": lambda a: getattr(a, "sliding_window", None) is not None or bool(getattr(a, "force_rope", False)),
    "afmoe": lambda a: bool(getattr(a, "is_local_attention", True)),
}


def _rotates(attn: torch.nn.Module) -> bool:
    """Whether ``attn`` rotates its queries: not in the layers without position embeddings
    (NoPE) of SmolLM3 and Llama 4 (``use_rope`` false) and of the families in
    `_ROTATES_IF` (the global layers of EXAONE 4, Cohere 2 and their kin)."""
    use_rope = getattr(attn, "use_rope", None)
    if use_rope is not None:
        return bool(use_rope)
    family = type(attn).__module__.rpartition(".modeling_")[2]
    rotates = _ROTATES_IF.get(family)
    return True if rotates is None else rotates(attn)


def _temperature(attn: torch.nn.Module, q: torch.Tensor, past: int) -> torch.Tensor:
    """``[batch, heads, n, head_dim]`` queries of a layer without RoPE scaled as Llama 4's
    attention scales them (attention temperature tuning): by ``1 + attn_scale *
    log1p(floor((p + 1) / floor_scale))`` at position ``p``, the first new token at
    ``past``, the cache's length as the attention asks for it."""
    pos = torch.arange(q.shape[-2], device=q.device, dtype=torch.float32) + past
    scales = torch.log1p(torch.floor((pos + 1.0) / attn.floor_scale)) * attn.attn_scale + 1.0
    return (q * scales.view(1, 1, -1, 1)).to(q.dtype)


def _heads_first(out: torch.Tensor, positions: int | None) -> bool:
    """Whether a 4-D output of a query norm is ``[batch, heads, n, head_dim]`` already
    (Gemma 3, EXAONE 4 norm the queries after the transpose) rather than ``[batch, n,
    heads, head_dim]`` (Qwen 3, Gemma 4, Cohere norm them before it). The shape tells
    unless ``n`` equals the head count; then the strides do: the norm keeps the layout of
    ``q_proj``'s output (positions outer, heads inner), so the positions' dimension is
    the one with the larger stride."""
    if out.dim() != 4 or positions is None:
        return False
    if out.shape[1] != out.shape[2]:
        return out.shape[2] == positions
    return out.stride(2) > out.stride(1)


_warned: set[str] = set()


def _warn_once(name: str, exc: BaseException) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning("the queries of %s cannot be captured (%s): sparse layers keep sink and recent rows", name, exc)


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
            head_dim = getattr(module, "head_dim", None)
            if isinstance(cache, cache_type) and cache.wants_queries and isinstance(head_dim, int):
                hidden = args[0] if args else kwargs.get("hidden_states")
                positions = hidden.shape[-2] if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 else None
                _capture.target = (cache, module, head_dim, kwargs.get("position_embeddings"), positions)
            else:
                _capture.target = None

        def took(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            target = getattr(_capture, "target", None)
            if target is None:
                return
            cache, attn, head_dim, rope, positions = target
            _capture.target = None
            try:
                if _heads_first(output, positions):
                    q = output
                else:
                    q = output.reshape(output.shape[0], output.shape[1], -1, head_dim).transpose(1, 2)
                if rope is not None and _rotates(attn):
                    q = _rotate(attn, q, rope)
                if getattr(attn, "attn_temperature_tuning", False) and not getattr(attn, "use_rope", True):
                    q = _temperature(attn, q, cache.get_seq_length(attn.layer_idx))
            except (RuntimeError, TypeError, ValueError) as exc:  # a family that rotates queries its own way
                _warn_once(type(attn).__name__, exc)
                return
            cache.capture_queries(attn.layer_idx, q)

        handles.append(attn.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(source.register_forward_hook(took))
    return handles
