"""The command line reads a store without a model and finds damaged files."""

from __future__ import annotations

import torch

from conftest import tiny_model
from helpers import assert_same_as_uncached
from impress_cache import ImpressConfig, ImpressStore
from impress_cache.cli import main
from impress_cache.store import CHUNK_DIR


def test_info_and_verify(tmp_path, capsys):
    model = tiny_model("llama")
    doc = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    with ImpressStore(tmp_path, model, ImpressConfig(chunk_tokens=16, important_ratio=1.0)) as store:
        assert_same_as_uncached(model, store, doc)
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert '"stored_prompts": 1' in out and '"model_type": "llama"' in out
    assert main(["verify", str(tmp_path)]) == 0
    (f,) = (tmp_path / CHUNK_DIR).iterdir()
    raw = bytearray(f.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + 5] ^= 1
    f.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path)]) == 1
    assert f.name in capsys.readouterr().out
