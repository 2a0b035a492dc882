"""What binds a store to one model and one probe setting, recorded in the index."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import probe as probe_codec
from ..config import ImpressConfig
from ..errors import ConfigError, StoreFormatError
from ..index.schema import CODEC_SCHEMA_VERSION
from ..index.sqlite import Index
from ..model_info import ModelSpec, model_spec


@dataclass(frozen=True)
class ProbeSpec:
    """Which KV heads the probe copy holds, and how it is encoded (fixed per store)."""

    query_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    encoding: str
    head_dim: int

    @property
    def record_bytes(self) -> int:
        return probe_codec.record_bytes(len(self.kv_heads), self.head_dim, self.encoding)


def choose_probe_heads(num_attention_heads: int, num_key_value_heads: int, probe_heads: int = 3) -> list[int]:
    """Pick probe query heads spread over different KV groups.

    Query head ``h`` belongs to KV group ``h // (num_attention_heads //
    num_key_value_heads)``. Probes are the first query head of each of the first
    ``probe_heads`` groups (9 query / 3 KV heads / 3 probes gives ``[0, 3, 6]``;
    multi-head attention gives the paper's ``[0, 1, 2]``); with more probes than groups,
    selection continues round-robin with the next query head inside each group.
    Returns sorted distinct query-head indices; raises ``ValueError`` on inconsistent
    arguments.
    """
    for name, val in (
        ("num_attention_heads", num_attention_heads),
        ("num_key_value_heads", num_key_value_heads),
        ("probe_heads", probe_heads),
    ):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    if num_key_value_heads > num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} must be a multiple of "
            f"num_key_value_heads={num_key_value_heads}"
        )
    if probe_heads > num_attention_heads:
        raise ValueError(f"probe_heads={probe_heads} exceeds num_attention_heads={num_attention_heads}")
    group = num_attention_heads // num_key_value_heads
    full_rounds, rem = divmod(probe_heads, num_key_value_heads)
    heads = [g * group + r for r in range(full_rounds) for g in range(num_key_value_heads)]
    heads.extend(g * group + full_rounds for g in range(rem))
    return sorted(heads)


#: the ``meta`` key of the model record's own checksum
MODEL_SUM = "model_sha256"


def model_sum(model: Any) -> str:
    """SHA-256 of a model record (its canonical JSON)."""
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()


def mark_codec(index: Index, model: Any) -> None:
    """A store whose model record names a ``kv_codec`` gets `CODEC_SCHEMA_VERSION`, which
    versions before the codec refuse (they would read its blocks as raw K/V)."""
    if isinstance(model, dict) and model.get("kv_codec") and not index.read_only:
        index.set_schema_version(CODEC_SCHEMA_VERSION)


def check_model_record(index: Index, model: Any) -> None:
    """Raise `StoreFormatError` (index damage, with the repair command) when the model
    record ``model`` read from ``index`` fails its own checksum. A store made before the
    checksum gets it here (when it is open for writing) from the record as it is."""
    if model is None:
        return
    want = model_sum(model)
    have = index.get_json(MODEL_SUM) if index.read_only else index.get_or_set_json(MODEL_SUM, want)
    if have is not None and have != want:
        raise StoreFormatError(
            f"the index {index.path} is damaged: its model record fails its checksum (the record says "
            f"{json.dumps(model, sort_keys=True)[:200]}). Rebuild the index from the chunk files with "
            f"`impress-cache verify --repair {index.path.parent}`."
        )


def recorded(index: Index, path: Path) -> tuple[ModelSpec, ProbeSpec]:
    """The model and probe settings an existing store records (for maintenance without
    the model); `StoreFormatError` when the directory holds no bound store."""
    model, probe = index.get_json("model"), index.get_json("probe")
    check_model_record(index, model)
    if model is None or probe is None:
        raise StoreFormatError(
            f"{path} holds no store bound to a model yet; open it once with the model (ImpressStore(path, model))"
        )
    spec = ModelSpec.from_dict(model)
    return spec, ProbeSpec(tuple(probe["query_heads"]), tuple(probe["kv_heads"]), probe["encoding"], spec.head_dim)


def bind(index: Index, model: torch.nn.Module, config: ImpressConfig, path: Path) -> tuple[ModelSpec, ProbeSpec]:
    """Record the model and probe settings in a new store, or check them against an
    existing one (`ModelMismatchError` / `ConfigError` naming every differing field)."""
    spec = model_spec(model, config.kv_dtype, config.kv_codec)
    if index.read_only:  # nothing to record: the store must be bound already
        recorded(index, path)
    # one transaction each: of two processes creating a store, one records its model
    stored = index.get_json("model") if index.read_only else index.get_or_set_json("model", spec.to_dict())
    check_model_record(index, stored)  # damage is not a mismatch
    mark_codec(index, stored)
    if isinstance(stored, dict) and stored.get("kv_codec") != spec.kv_codec:
        raise ConfigError(
            f"the store at {path} keeps K/V blocks with kv_codec={stored.get('kv_codec')!r}, the config gives "
            f"kv_codec={spec.kv_codec!r}; a store's codec is fixed when it is created: open it with "
            f"kv_codec={stored.get('kv_codec')!r}, or use a new directory for the other codec"
        )
    spec.check_same(stored, str(path))
    q = choose_probe_heads(spec.num_attention_heads, spec.num_kv_heads, min(config.probe_heads, spec.num_attention_heads))
    group = spec.num_attention_heads // spec.num_kv_heads
    kv = tuple(sorted({h // group for h in q}))
    want = {"query_heads": list(q), "kv_heads": list(kv), "encoding": config.probe_dtype}
    stored_probe = index.get_json("probe") if index.read_only else index.get_or_set_json("probe", want)
    if stored_probe != want:
        diffs = [
            f"{k}: store has {stored_probe.get(k)!r}, config gives {want[k]!r}"
            for k in want
            if stored_probe.get(k) != want[k]
        ]
        raise ConfigError(
            f"the store at {path} keeps probe keys for other settings ({'; '.join(diffs)}); "
            "use the probe_heads / probe_dtype it was created with"
        )
    return spec, ProbeSpec(tuple(q), kv, config.probe_dtype, spec.head_dim)
