"""What differs between the transformers versions this package supports (5.23 and 5.24).

transformers 5.24 renamed the cache argument of every forward, ``generate``,
``prepare_inputs_for_generation`` and mask helper from ``past_key_values`` to ``cache``
(the old name still works, with a ``FutureWarning``, until 5.40 / 6.0). Hooks see the
arguments as the caller passed them, so they look for both names; `CACHE_KWARG` is the
name the installed version's ``generate`` understands. The other 5.24 changes need no
branch here (see the Compatibility section of docs/design.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from transformers.generation.utils import GenerationMixin

#: keyword names under which a forward or ``generate`` may receive the cache, newest first
CACHE_KWARGS = ("cache", "past_key_values")

#: the name the installed transformers gives the cache argument (``cache`` from 5.24 on)
CACHE_KWARG = (
    "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters else "past_key_values"
)


def cache_argument(kwargs: Mapping[str, Any]) -> Any:
    """The cache a call received, under either name (``None`` if none)."""
    for name in CACHE_KWARGS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def generate_attention_mask(input_ids: torch.Tensor, generation_config: Any, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The attention mask ``generate`` derives when it is given none (``None``: all ones).

    Both supported versions do the same (``_prepare_attention_mask_for_generation``):
    when the pad token occurs in ``input_ids`` and is not an end-of-sequence token, the
    mask is ``input_ids != pad``; otherwise every token is attended.
    """
    pad = kwargs.get("pad_token_id", getattr(generation_config, "pad_token_id", None))
    eos = kwargs.get("eos_token_id", getattr(generation_config, "eos_token_id", None))
    if pad is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return None
    pad_ids = torch.as_tensor(pad).reshape(-1)
    eos_ids = torch.as_tensor(eos if eos is not None else []).reshape(-1)
    if not torch.isin(input_ids.cpu(), pad_ids).any() or torch.isin(pad_ids, eos_ids).any():
        return None
    return input_ids.ne(int(pad_ids[0])).long()


#: parts of ``generate`` argument names that carry images, audio or video
_NON_TEXT_INPUTS = ("pixel_values", "image", "video", "audio", "input_features", "input_values")


def unsupported_generation(model: torch.nn.Module, kwargs: Mapping[str, Any]) -> str | None:
    """Name the generation feature of a ``generate`` call an ImpressCache cannot serve, if any.

    Assisted decoding in every form (``assistant_model``, ``prompt_lookup_num_tokens``,
    ``assistant_early_exit``, multi-token prediction) runs the whole prompt plus draft
    tokens in its first forward without asking the cache how much it holds, and chunked
    prefill (``prefill_chunk_size``) shows ``prepare_inputs_for_generation`` one chunk
    at a time; both in 5.23 and 5.24. Images, audio or video (``pixel_values=`` and
    the like) make K/V that token ids alone do not determine.
    """
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def setting(name: str) -> Any:
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    for name, value in kwargs.items():
        if value is not None and any(part in name for part in _NON_TEXT_INPUTS):
            return (
                f"a prompt with non-text inputs ({name}=): its K/V depend on more than the token ids, "
                "so a store keyed on token ids must not serve or keep it"
            )
    first_step = ": transformers runs the prompt and draft tokens in its first step without asking the cache what it holds"
    if kwargs.get("assistant_model") is not None:
        return "assisted decoding (assistant_model=)" + first_step
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if setting(name) is not None:
            return f"assisted decoding ({name}=)" + first_step
    if setting("use_mtp"):
        return "multi-token-prediction decoding (use_mtp=)" + first_step
    if setting("prefill_chunk_size") is not None:
        return "chunked prefill (prefill_chunk_size=): prepare_inputs_for_generation sees one chunk at a time"
    return None
