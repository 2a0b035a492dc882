"""Loading the one model a server serves: a local Hugging Face model directory or a
GGUF file (de-quantised by transformers, as ``transformers serve`` loads GGUF weights)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """The served model, its tokenizer, the id clients name it by and its context length."""

    model: Any
    tokenizer: Any
    model_id: str
    context: int

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def _context_length(model: Any) -> int:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the context length of {type(model).__name__}: set max_position_embeddings")


def load_model(path: str | Path, model_id: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load ``path``: a directory with a Hugging Face model (``config.json``, weights,
    tokenizer) or a ``.gguf`` file (its config and tokenizer come from the file).

    ``model_id`` is the name clients use in ``model``; by default the directory's name,
    or the GGUF file's name without ``.gguf``. Raises `FileNotFoundError` or `ValueError`
    naming what is wrong with ``path``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}: give a Hugging Face model directory or a .gguf file")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; give a model directory or a GGUF file")
        kwargs: dict[str, Any] = {"gguf_file": path.name}
        folder, default_id = path.parent, path.stem
    else:
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: not a Hugging Face model directory")
        kwargs, folder, default_id = {}, path, path.name
    log.info("loading %s", path)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model, tokenizer, model_id or default_id, _context_length(model))
