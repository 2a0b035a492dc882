"""A tiny random Llama with SmolLM2's tokenizer (and its chat template) saved as a model
directory, and ``impress-cache serve`` on it as a real subprocess on a free port."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from impress_cache.serve.launch import ServerProcess, free_port, impress_serve_command

SRC = str(Path(__file__).resolve().parents[2] / "src")
#: the tiny model's context: prompts longer than this are refused
CONTEXT = 1024


def start_server(model_dir: Path, store: Path, log: Path, *extra: str) -> ServerProcess:
    port = free_port()
    env = {"PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    server = ServerProcess(impress_serve_command(model_dir, store, port, *extra), port, log, env=env)
    return server.start(timeout=240)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama over SmolLM2's vocabulary, with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from impress_cache.tools.models import SMOLLM2_FILE, smollm2_path

    path = tmp_path_factory.mktemp("tiny-chat")
    tok = AutoTokenizer.from_pretrained(smollm2_path(), gguf_file=SMOLLM2_FILE)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    srv = start_server(model_dir, root / "stores", root / "server.log")
    srv.root = root / "stores"
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def salt() -> str:
    """A tenant of one test's own (tests share the server)."""
    return uuid.uuid4().hex
