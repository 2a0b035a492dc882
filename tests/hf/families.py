"""Tiny random models of every decoder-only text family the cache serves, built from
transformers' own configs (no download): 4 layers, windows of 8 tokens where the family
has sliding or chunked layers, so that a 90-token prompt exercises hidden rows."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import VOCAB

_BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=1024,
)
_WINDOW = dict(sliding_window=8)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
#: multi-head latent attention as transformers caches it: keys wider than values
_MLA = dict(
    num_key_value_heads=4, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=8, kv_lora_rank=32,
    first_k_dense_replace=1, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2, moe_intermediate_size=32,
)
#: small per-layer input embeddings; the global layers keep their wider head dim (512)
_GEMMA4 = dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)

#: family (transformers model_type) -> config overrides
FAMILIES: dict[str, dict] = {
    "llama": {}, "mistral": dict(sliding_window=None), "qwen2": {}, "qwen3": {}, "gemma": {},
    "gemma2": _WINDOW, "gemma3_text": _WINDOW, "gemma4_text": dict(_WINDOW, **_GEMMA4),
    "gemma4_text-shared": dict(
        _WINDOW, **_GEMMA4, num_hidden_layers=6, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 3
    ),
    "gpt_oss": dict(_MOE, **_WINDOW), "phi3": {}, "olmo2": {}, "olmo3": _WINDOW, "smollm3": {}, "granite": {},
    "cohere2": _WINDOW, "glm4": {}, "exaone4": _WINDOW, "qwen3_moe": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "llama4_text": dict(attention_chunk_size=8),
    "deepseek_v3": _MLA,
    "seed_oss": {}, "hunyuan_v1_dense": {}, "ministral": _WINDOW, "mixtral": {}, "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "starcoder2": {}, "olmo": {}, "cohere": {}, "stablelm": {}, "helium": {}, "glm": {}, "nemotron": {},
}

_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
#: hybrid families: recurrent-state layers (linear attention, convolution, Mamba) beside attention
STATE_FAMILIES = {
    "qwen3_next": dict(
        _LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "qwen3_5_text": _LINEAR, "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16),
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_d_state=8, mamba_n_heads=8, mamba_d_head=16,
        mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2,
    ),
}
#: layers the cache cannot serve exactly (an indexer choosing the rows each query sees):
#: refused, naming the layer
REFUSED_FAMILIES = {
    "glm_moe_dsa": dict(_MLA, q_lora_rank=32, index_n_heads=2, index_head_dim=16),
    # a cache class of its own, whose trailing linear layers have no DynamicCache layer
    "minimax": dict(_MOE, layer_types=["full_attention", "full_attention", "linear_attention", "linear_attention"]),
}


def family_model(name: str, attn: str | None = None, **overrides) -> torch.nn.Module:
    """The tiny model of family ``name`` (``gemma4_text-shared``: with shared-K/V layers),
    with ``attn`` or the family's default attention (sdpa where it has it, else eager)."""
    table = {**FAMILIES, **STATE_FAMILIES, **REFUSED_FAMILIES}
    cfg = AutoConfig.for_model(name.split("-")[0], **{**_BASE, **table[name], **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, **({"attn_implementation": attn} if attn else {})).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
