"""What a store needs to know about a model, and the fingerprint that binds them.

No list of model types: each layer's behaviour comes from what transformers itself says
the layer is. One forward of two tokens shows the cache layers transformers builds for
the model (``DynamicCache(config=...)`` dispatches on the text config's ``layer_types``)
and the shapes of their keys and values; `LayerInfo` records, per model layer, its kind
(`LAYER_KINDS`), its window and its K/V shapes. Full and window layers store K/V; a layer
that reuses another layer's K/V, or has no attention, stores nothing. A layer that keeps a
recurrent state (linear attention, SSM, convolution) stores no rows: its state is kept in
checkpoints (`store.states`); a layer with a state and full-attention K/V in one
(Falcon-H1) has both. Any other cache layer is refused, naming the layer.

The store keeps every stored layer at one padded width (the largest KV-head count and
head dim over the stored layers; keys and values of different widths are padded to the
wider one) and slices each layer back to its own shape when it is read.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any

import torch

from .errors import ModelMismatchError, UnsupportedModelError
from .storage.kv_codec import row_bytes as codec_row_bytes

#: what a model layer is, for the cache:
#: ``full``: attends to every earlier row (stored; sparse loading possible);
#: ``window``: sliding-window or chunked attention (stored; only the rows still visible
#: at the match point are read);
#: ``shared``: uses another layer's K/V, or has no attention (nothing stored);
#: ``state``: keeps a recurrent state valid at one position (checkpoints, no rows);
#: ``hybrid``: a recurrent state and full-attention K/V in one layer (both)
LAYER_KINDS = ("full", "window", "shared", "state", "hybrid")

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class LayerInfo:
    """One model layer as the cache sees it."""

    kind: str
    #: transformers' name for it (``layer_types``: full_attention, sliding_attention, ...)
    layer_type: str = "full_attention"
    #: window kind: rows a new token can still see are the last ``window - 1``
    window: int = 0
    k_heads: int = 0
    k_dim: int = 0
    v_heads: int = 0
    v_dim: int = 0
    #: state kind: how many conv / recurrent states the layer keeps
    states: int = 0

    @property
    def stored(self) -> bool:
        return self.kind in ("full", "window", "hybrid")

    def as_list(self) -> list[Any]:
        return [self.kind, self.layer_type, self.window, self.k_heads, self.k_dim, self.v_heads, self.v_dim, self.states]


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model's KV cache plus a fingerprint of its weights.

    Two models with equal specs produce the same keys and values for the same tokens,
    so a store records the spec it was built with and refuses any other model.
    ``num_layers``, ``num_kv_heads`` and ``head_dim`` describe what the store keeps: the
    stored layers, at their padded width. ``layers`` describes every model layer
    (`LayerInfo`, JSON); it is empty for a model whose layers all attend fully with one
    shape, so stores of such models written before it existed keep their fingerprint.
    ``kv_codec`` is the encoding of K/V blocks at rest (`storage.kv_codec`), ``None`` for
    the dtype itself; it is in the record (`to_dict`) only when set, so the records of
    stores without a codec are what they were before it existed.
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
    layers: str = ""
    kv_codec: str | None = None

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return _NAME_DTYPES[self.kv_dtype]

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one row of one layer's K/V block on disk (K and V of every head):
        in the stored dtype, or encoded with ``kv_codec``."""
        if self.kv_codec is not None:
            return codec_row_bytes(self.num_kv_heads, self.head_dim)
        return self.dense_row_bytes

    @property
    def dense_row_bytes(self) -> int:
        """Bytes of one row of one layer's K/V in memory (K and V of every head, in the
        stored dtype: what a block decodes to)."""
        itemsize = torch.empty((), dtype=self.torch_kv_dtype).element_size()
        return 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all stored layers, as stored on disk."""
        return self.num_layers * self.kv_row_bytes

    @functools.cached_property
    def model_layers(self) -> tuple[LayerInfo, ...]:
        """Every layer of the model, in order."""
        if not self.layers:
            h, d = self.num_kv_heads, self.head_dim
            return tuple(LayerInfo("full", "full_attention", 0, h, d, h, d) for _ in range(self.num_layers))
        return tuple(LayerInfo(*row) for row in json.loads(self.layers))

    @functools.cached_property
    def state_layers(self) -> tuple[int, ...]:
        """Model layer index of every layer that keeps a recurrent state."""
        return tuple(i for i, info in enumerate(self.model_layers) if info.kind in ("state", "hybrid"))

    @functools.cached_property
    def stored_layers(self) -> tuple[int, ...]:
        """Model layer index of every stored layer (stored layer ``i`` is model layer
        ``stored_layers[i]``)."""
        return tuple(i for i, info in enumerate(self.model_layers) if info.stored)

    def padded(self, layer: int) -> bool:
        """Whether stored layer ``layer`` is kept wider than its own K or V."""
        info = self.model_layers[self.stored_layers[layer]]
        h, d = self.num_kv_heads, self.head_dim
        return (info.k_heads, info.k_dim, info.v_heads, info.v_dim) != (h, d, h, d)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["kv_codec"] is None:
            del out["kv_codec"]
        return out

    def check_same(self, stored: dict[str, Any], where: str) -> None:
        """Raise `ModelMismatchError` naming every field that differs (a field a store
        written before it existed did not record counts as its default)."""
        mine = {f.name: getattr(self, f.name) for f in fields(self)}
        defaults = {f.name: f.default for f in fields(self)}
        diffs = [
            f"{k}: store has {stored.get(k, defaults[k])!r}, model has {mine[k]!r}"
            for k in mine
            if not _same_value(k, stored.get(k, defaults[k]), mine[k])
        ]
        if diffs:
            raise ModelMismatchError(
                f"the store at {where} was built for another model; differing fields: "
                + "; ".join(diffs)
                + ". Open a new store directory for this model."
            )

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "ModelSpec":
        """The spec a store recorded (fields it does not know are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


def _sorted_dicts(value: Any) -> Any:
    """``value`` with every dict in it rebuilt in sorted key order, so that its ``repr``
    does not depend on the order a config listed the keys in (`model_spec`'s ``rope``)."""
    if isinstance(value, dict):
        return {k: _sorted_dicts(value[k]) for k in sorted(value, key=repr)}
    if isinstance(value, list):
        return [_sorted_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_sorted_dicts(v) for v in value)
    return value


def _same_value(name: str, stored: Any, mine: Any) -> bool:
    """Whether a recorded field equals the model's. ``rope`` is compared by value: its
    text lists every level of the parameters in sorted key order (`_sorted_dicts`), but
    stores written before that kept the config's order in nested dicts (per layer type:
    Gemma 3), which a config saved and read back (a converted GGUF model, a
    ``save_pretrained`` copy) may change."""
    if stored == mine:
        return True
    if name == "rope" and isinstance(stored, str) and isinstance(mine, str):
        try:
            return bool(ast.literal_eval(stored) == ast.literal_eval(mine))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return False
    return False


def same_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two recorded model specs (`ModelSpec.to_dict`: an index's, a chunk file's
    header's) are the same model's: the same fields, each equal as `ModelSpec.check_same`
    compares them (``rope`` by value: a file written before nested rope keys were sorted
    records them in the config's order, its store's later files sorted)."""
    return a.keys() == b.keys() and all(_same_value(k, a[k], b[k]) for k in a)


def text_config(model: torch.nn.Module) -> Any:
    """The model's decoder text config; `UnsupportedModelError` for anything that is not a
    Hugging Face model with a config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise UnsupportedModelError(
            f"expected a Hugging Face causal LM with a .config, got {type(model).__name__}"
        )
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def describe_layers(model: torch.nn.Module) -> list[LayerInfo]:
    """Every layer of ``model`` as transformers caches it (one forward of two tokens).

    Raises `UnsupportedModelError`, naming the layer, its kind and the model, for a layer
    whose cache this library cannot serve exactly (an indexer, a state beside
    sliding-window K/V), and for a model whose cache is not one layer per model layer
    (a model with a cache class of its own).
    """
    text = text_config(model)
    name = f"{text.model_type} ({type(model).__name__})"
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    # one thread: two tokens need no more, and a process forked from one that ran torch
    # with a thread pool would hang in that pool (the store is often opened in such a child)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[1, 2]], device=device), use_cache=True)
    finally:
        torch.set_num_threads(threads)
    cache = out.get("cache", None) or out.get("past_key_values", None)  # (5.24 / 5.23 names; no deprecated property)
    cache_layers = getattr(cache, "layers", None)
    if cache_layers is None:
        raise UnsupportedModelError(f"{name} returned no layered cache from a forward with use_cache=True")
    layers = int(getattr(text, "num_hidden_layers", len(cache_layers)))
    if type(cache).__name__ != "DynamicCache" or len(cache_layers) != layers:
        raise UnsupportedModelError(
            f"{name} keeps its cache in a {type(cache).__name__} of {len(cache_layers)} layers for its {layers} "
            "layers; impress_cache serves models whose cache is transformers' DynamicCache, one layer per model layer"
        )
    types = list(getattr(text, "layer_types", None) or [])
    infos: list[LayerInfo] = []
    for i, layer in enumerate(cache_layers):
        cls = type(layer).__name__
        layer_type = str(types[i]) if i < len(types) else "full_attention"
        where = f"layer {i} of {name} ({layer_type}, transformers cache layer {cls})"
        if cls == "LinearAttentionAndSlidingWindowAttentionLayer":
            raise UnsupportedModelError(
                f"{where} keeps a recurrent state and sliding-window K/V in one layer; impress_cache serves a state "
                "with full-attention K/V in one layer, not with a window yet"
            )
        if cls == "LinearAttentionLayer":
            infos.append(LayerInfo("state", layer_type, states=int(getattr(layer, "number_of_states", 1))))
            continue
        if cls == "DummyLayer":  # reuses another layer's K/V (kv sharing), or no attention at all
            infos.append(LayerInfo("shared", layer_type))
            continue
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        hybrid = cls == "LinearAttentionAndFullAttentionLayer"
        if cls not in ("DynamicLayer", "DynamicSlidingWindowLayer") and not hybrid or not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            raise UnsupportedModelError(f"{where} is not a kind of layer impress_cache serves (full, sliding, chunked or shared attention, "
                "a recurrent state, or a state with full attention)")
        assert isinstance(values, torch.Tensor)
        window = int(getattr(layer, "sliding_window", 0) or 0) if getattr(layer, "is_sliding", False) else 0
        infos.append(LayerInfo(
            "hybrid" if hybrid else "window" if window else "full", layer_type, window,
            int(keys.shape[1]), int(keys.shape[3]), int(values.shape[1]), int(values.shape[3]),
            int(getattr(layer, "number_of_states", 1)) if hybrid else 0,
        ))
    if not any(info.stored for info in infos):
        raise UnsupportedModelError(f"{name} has no layer with K/V to store")
    return infos


def model_spec(model: torch.nn.Module, kv_dtype: str = "auto", kv_codec: str | None = None) -> ModelSpec:
    """Describe ``model`` for a store that keeps K/V in ``kv_dtype`` (encoded with
    ``kv_codec`` on disk when it is set)."""
    text = text_config(model)
    infos = describe_layers(model)
    heads = int(text.num_attention_heads)
    stored = [info for info in infos if info.stored]
    kv_heads = max(max(i.k_heads, i.v_heads) for i in stored)
    head_dim = max(max(i.k_dim, i.v_dim) for i in stored)
    uniform = all(i.kind == "full" and (i.k_heads, i.k_dim, i.v_heads, i.v_dim) == (kv_heads, head_dim, kv_heads, head_dim) for i in infos)
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
        num_layers=len(stored),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        rope=repr(sorted((k, _sorted_dicts(v)) for k, v in rope.items())) if isinstance(rope, dict) else repr(rope),
        kv_dtype=kv_dtype,
        weights_sha256=weights_fingerprint(model),
        layers="" if uniform else json.dumps([i.as_list() for i in infos]),
        kv_codec=kv_codec,
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
