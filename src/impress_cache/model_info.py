"""What a store needs to know about a model, and the fingerprint that binds them."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .errors import ModelMismatchError, UnsupportedModelError

#: ``config.model_type`` values whose attention layout this library understands
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model's KV cache plus a fingerprint of its weights.

    Two models with equal specs produce the same keys and values for the same tokens,
    so a store records the spec it was built with and refuses any other model.
    """

    model_type: str
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    rope: str
    kv_dtype: str
    weights_sha256: str

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return _NAME_DTYPES[self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, in the stored dtype."""
        itemsize = torch.empty((), dtype=self.torch_kv_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_same(self, stored: dict[str, Any], where: str) -> None:
        """Raise `ModelMismatchError` naming every field that differs."""
        mine = self.to_dict()
        diffs = [
            f"{k}: store has {stored.get(k)!r}, model has {mine[k]!r}"
            for k in mine
            if stored.get(k) != mine[k]
        ]
        if diffs:
            raise ModelMismatchError(
                f"the store at {where} was built for another model; differing fields: "
                + "; ".join(diffs)
                + ". Open a new store directory for this model."
            )


def check_supported(model: torch.nn.Module) -> Any:
    """Return the model's text config, or raise if its architecture is not supported."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise UnsupportedModelError(
            f"expected a Hugging Face causal LM with a .config, got {type(model).__name__}"
        )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if text.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {text.model_type!r} is not supported; supported architectures: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    return text


def model_spec(model: torch.nn.Module, kv_dtype: str = "auto") -> ModelSpec:
    """Describe ``model`` for a store that keeps K/V in ``kv_dtype``."""
    text = check_supported(model)
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if kv_dtype == "auto":
        dtype = next(model.parameters()).dtype
        if dtype not in _DTYPE_NAMES:
            raise UnsupportedModelError(f"model dtype {dtype} is not supported for stored K/V")
        kv_dtype = _DTYPE_NAMES[dtype]
    rope = getattr(text, "rope_parameters", None) or {
        "rope_theta": getattr(text, "rope_theta", None),
        "rope_scaling": getattr(text, "rope_scaling", None),
    }
    return ModelSpec(
        model_type=text.model_type,
        architecture=(getattr(model.config, "architectures", None) or [type(model).__name__])[0],
        num_layers=int(text.num_hidden_layers),
        num_attention_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        rope=repr(sorted(rope.items())) if isinstance(rope, dict) else repr(rope),
        kv_dtype=kv_dtype,
        weights_sha256=weights_fingerprint(model),
    )


def weights_fingerprint(model: torch.nn.Module, samples: int = 4096) -> str:
    """SHA-256 over every parameter's name, shape, dtype and an evenly strided sample.

    Sampling keeps this fast on large models (a few milliseconds per parameter) while a
    different checkpoint or a fine-tune changes almost every sampled value.
    """
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // samples)
            sample = flat[::step][:samples].to("cpu", torch.float32).contiguous()
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()
