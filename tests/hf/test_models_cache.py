"""The real models' converted copies (`impress_cache.tools.models`): the first load of a
GGUF file keeps its dequantised weights, config and tokenizer in the models cache; later
loads read that copy and get the same model; a damaged copy is converted again, never
loaded; a copy that cannot be written costs only the next load."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from conftest import tiny_model
from impress_cache.tools.models import CONVERTED_MARK, SMOLLM2_FILE, _keep_converted, load_gguf, smollm2_path

TEXT = "The quick brown fox. Überprüfung 東京 🙂 <|im_start|>user\nhi<|im_end|>"


def _same(a, b) -> None:
    (ma, ta), (mb, tb) = a, b
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ta(TEXT).input_ids == tb(TEXT).input_ids
    chat = [{"role": "user", "content": "What is a prefix cache?"}]
    assert ta.apply_chat_template(chat, tokenize=False) == tb.apply_chat_template(chat, tokenize=False)
    assert (ta.padding_side, ta.pad_token_id) == (tb.padding_side, tb.pad_token_id)
    ids = torch.tensor([ta("A prefix cache keeps").input_ids])
    with torch.no_grad():
        assert torch.equal(ma(ids).logits, mb(ids).logits)


@pytest.mark.slow
def test_a_converted_copy_loads_the_same_model_and_a_damaged_one_is_converted_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("IMPRESS_CACHE_MODELS", str(tmp_path))
    converted = load_gguf(smollm2_path(), SMOLLM2_FILE, converted=False)  # dequantised from the GGUF file
    assert not (tmp_path / "converted").exists()  # (kept nothing)
    _same(converted, load_gguf(smollm2_path(), SMOLLM2_FILE))  # dequantised, kept, read back
    (folder,) = (tmp_path / "converted").iterdir()
    assert (folder / CONVERTED_MARK).exists() and (folder / "model.safetensors").exists()
    assert not [p for p in (tmp_path / "converted").iterdir() if p.name.startswith(".")]  # no partial folder left
    _same(converted, load_gguf(smollm2_path(), SMOLLM2_FILE))

    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:  # one flipped byte inside the tensors' data
        f.seek(weights.stat().st_size - 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    with caplog.at_level(logging.WARNING, logger="impress_cache.tools.models"):
        again = load_gguf(smollm2_path(), SMOLLM2_FILE)
    assert "unreadable" in caplog.text and "checksum" in caplog.text
    _same(converted, again)
    _same(converted, load_gguf(smollm2_path(), SMOLLM2_FILE))  # the copy was kept again, whole


def test_a_copy_that_cannot_be_written_is_not_kept_and_raises_nothing(tmp_path):
    """The disk fills up while the weights are written (here: a file size limit, so the
    write fails with ``EFBIG`` as it would with ``ENOSPC``; safetensors reports it as its
    own error, not an ``OSError``): the load goes on without a copy, nothing is left."""
    import resource
    import signal

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama")  # ~0.4 MB of float32 weights
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")))
    target = tmp_path / "converted" / "tiny-0123456789abcdef"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (the default action ends the process)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        _keep_converted(model, tok, target, "tiny.gguf")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no partial folder left either
    _keep_converted(model, tok, target, "tiny.gguf")  # room again: kept
    assert (target / CONVERTED_MARK).exists()


@pytest.mark.slow
def test_the_first_load_gives_the_model_later_loads_give(tmp_path):
    """The load that converts the GGUF file returns the model as later loads read it back
    from the copy: the same `ModelSpec` (Gemma 3's per-layer-type rope parameters come
    back from the copy's JSON with their keys in another order, which changed the spec's
    ``rope``: a store written after the first load refused the model of every later one)
    and a tokenizer that encodes the same (its beginning-of-sequence token too)."""
    from impress_cache.model_info import model_spec
    from impress_cache.tools import load_gemma3_270m

    first_model, first_tok = load_gemma3_270m(cache_dir=tmp_path)  # assembled, converted, kept there
    assert len(list((tmp_path / "converted").iterdir())) == 1  # the copy follows ``cache_dir``
    later_model, later_tok = load_gemma3_270m(cache_dir=tmp_path)
    assert model_spec(first_model) == model_spec(later_model)
    for text in ["", "The quick brown fox.", "<start_of_turn>user\nhi<end_of_turn>"]:
        ids = first_tok(text).input_ids
        assert ids == later_tok(text).input_ids and ids[:1] == [first_tok.bos_token_id]


def test_a_conversion_s_folder_left_by_a_killed_process_is_removed_by_the_next_one(tmp_path):
    """A conversion killed mid-write leaves its temporary folder (0.5-1.1 GB); the next
    conversion into the same name removes it, and leaves a live process's alone."""
    from impress_cache.tools.models import _remove_abandoned

    target = tmp_path / "converted" / "model-0123"
    target.parent.mkdir()
    gone = target.parent / f".{target.name}.{2**22 + 11}.part"  # above Linux's largest pid
    alive = target.parent / f".{target.name}.{os.getppid()}.part"
    other = target.parent / ".another-model.12.part"
    for d in (gone, alive, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 100)
    _remove_abandoned(target)
    assert not gone.exists() and alive.exists() and other.exists()
