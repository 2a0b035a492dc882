"""Input checks: what a request may pass, and that ``generate`` runs the prompt it was built for.

The model's forward only sees the tokens after the reused prefix, so these checks are
what stops a cache built for one prompt from serving its K/V to another.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CacheUsageError

_SAME_IDS = (
    "the input_ids given to {where} differ from those this ImpressCache was built for; "
    "pass the same input_ids to ImpressCache(...) and generate(...), and build a new cache per request"
)
_SAME_MASK = (
    "the attention_mask given to generate differs from the one ImpressCache was built with; "
    "pass the same attention_mask to ImpressCache(store, input_ids, attention_mask=...)"
)


def check_inputs(input_ids: Any, attention_mask: Any, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a prompt; return CPU ``int64`` ids and a ``bool`` mask (left padding only)."""
    if not isinstance(input_ids, torch.Tensor):
        raise CacheUsageError(
            f"input_ids must be a torch.Tensor of token ids of shape [batch, seq], got {type(input_ids).__name__}"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise CacheUsageError(f"input_ids must have shape [batch, seq] with batch, seq >= 1, got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise CacheUsageError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    ids = input_ids.detach().to("cpu", torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise CacheUsageError(f"input_ids must be token ids in [0, {vocab_size}), got values up to {int(ids.max())}")
    if attention_mask is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(ids.shape):
        raise CacheUsageError(
            f"attention_mask must be a tensor of the same shape as input_ids {tuple(ids.shape)}, "
            f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}"
        )
    mask = attention_mask.detach().to("cpu").bool()
    lengths = mask.sum(dim=1)
    seq = ids.shape[1]
    left_padded = torch.arange(seq).unsqueeze(0) >= (seq - lengths).unsqueeze(1)
    if not torch.equal(mask, left_padded) or int(lengths.min()) < 1:
        raise CacheUsageError(
            "attention_mask must be left padding only (zeros then ones, at least one token per row); "
            "set tokenizer.padding_side = 'left'"
        )
    return ids, mask


class PromptGuard:
    """Tracks where a request is (``ready`` -> ``prefill`` -> ``decoding``) and checks every
    forward against the prompt.

    ``prompt`` is the request (its ``ids``, ``mask`` and ``reused`` columns, read at
    every check, so an expanded request is checked as expanded); ``expand(repeats)`` is
    called when ``generate`` runs a batch that is a multiple of the cache's
    (``num_return_sequences``, beams).
    """

    def __init__(self, prompt: Any) -> None:
        self._prompt = prompt
        self.state = "ready"
        self._checked = False
        self._consumed = 0

    def check_prompt(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, expand: Any) -> None:
        """``generate`` (through ``prepare_inputs_for_generation``) shows the whole prompt."""
        if self.state != "ready" or self._checked:
            return
        if input_ids is None:
            raise CacheUsageError("ImpressCache needs input_ids; inputs_embeds alone are not supported")
        self.match_batch(input_ids.shape[0], expand)
        seq = self.ids.shape[1]
        if input_ids.shape[1] > seq and torch.equal(input_ids[:, :seq].to("cpu"), self.ids):
            raise CacheUsageError(
                "generate ran more tokens than the prompt in its first step (assisted or prompt-lookup decoding); "
                "that is not supported with an ImpressCache"
            )
        if input_ids.shape != self.ids.shape or not torch.equal(input_ids.to("cpu"), self.ids):
            raise CacheUsageError(_SAME_IDS.format(where="generate"))
        mask = torch.ones_like(self.ids, dtype=torch.bool) if attention_mask is None else attention_mask.to("cpu").bool()
        if mask.shape != self.mask.shape or not torch.equal(mask, self.mask):
            raise CacheUsageError(_SAME_MASK)
        self._checked = True

    def check_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, expand: Any) -> bool:
        """Before every forward that uses the cache; returns True for a decode step."""
        if input_ids is None:
            raise CacheUsageError("ImpressCache needs input_ids; inputs_embeds alone are not supported")
        self.match_batch(input_ids.shape[0], expand)
        seq = self.ids.shape[1]
        q = input_ids.shape[1]
        if self.state == "decoding":
            if q != 1:
                raise CacheUsageError(
                    "this ImpressCache already served a request; build a new ImpressCache for every "
                    "generate call (multi-token steps such as assisted decoding are not supported either)"
                )
            return True
        start = self.reused if self.state == "ready" else self._consumed
        if q > seq - start and self.state == "ready" and start > 0:
            raise CacheUsageError(
                f"the model got {q} tokens, but this ImpressCache holds {start} of the prompt's {seq} and expected the "
                f"other {seq - start}: the caller did not ask the cache its length first (assisted and prompt-lookup "
                "decoding do not); that is not supported with an ImpressCache"
            )
        if q > seq - start or not torch.equal(input_ids.to("cpu"), self.ids[:, start : start + q]):
            raise CacheUsageError(_SAME_IDS.format(where="the model"))
        if attention_mask is not None and attention_mask.dim() == 2:
            m = attention_mask[:, : self.reused].to("cpu").bool()
            if m.shape != (self.ids.shape[0], self.reused) or not torch.equal(m, self.mask[:, : self.reused]):
                raise CacheUsageError(_SAME_MASK)
        self._consumed = start + q
        self.state = "prefill" if self._consumed < seq else "decoding"
        return False

    @property
    def ids(self) -> torch.Tensor:
        return self._prompt.ids

    @property
    def mask(self) -> torch.Tensor:
        return self._prompt.mask

    @property
    def reused(self) -> int:
        return self._prompt.reused

    def match_batch(self, rows: int, expand: Any) -> None:
        batch = self.ids.shape[0]
        if rows == batch:
            return
        if self.state != "ready" or rows % batch:
            raise CacheUsageError(f"this cache was built for a batch of {batch} rows, the model got {rows}")
        expand(rows // batch)
