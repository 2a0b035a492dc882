"""Compact probe-key copies: a few KV heads' keys per token, in a small encoding.

Probing reads these instead of the K/V blocks. On a model with few KV heads (SmolLM2 has
3) the probe heads cover every KV head, so the copy's size is set by its encoding:

=========  ===========================  ===========================================
encoding   bytes per token and head     relative to one fp32 K+V row of that head
=========  ===========================  ===========================================
float16    2 * head_dim                 1/4
int8       head_dim + 2 (fp16 scale)    ~1/7.8 (head_dim 64)
int4       head_dim / 2 + 2             ~1/15 (head_dim 64)
=========  ===========================  ===========================================

Records are token-major (``[tokens, heads, record]``) so a run of tokens is one
contiguous byte range. Quantisation is symmetric, one scale per token and head.
"""

from __future__ import annotations

import torch

ENCODINGS = ("float16", "int8", "int4")


def record_bytes(heads: int, head_dim: int, encoding: str) -> int:
    """Bytes one token takes in the probe copy."""
    if encoding == "float16":
        per_head = 2 * head_dim
    elif encoding == "int8":
        per_head = head_dim + 2
    elif encoding == "int4":
        if head_dim % 2:
            raise ValueError("int4 probe keys need an even head_dim")
        per_head = head_dim // 2 + 2
    else:
        raise ValueError(f"probe encoding must be one of {ENCODINGS}, got {encoding!r}")
    return heads * per_head


def encode(keys: torch.Tensor, encoding: str) -> torch.Tensor:
    """``[heads, tokens, head_dim]`` float keys -> ``uint8 [tokens, record_bytes]``."""
    h, n, d = keys.shape
    x = keys.detach().to("cpu", torch.float32).transpose(0, 1)  # [n, h, d]
    if encoding == "float16":
        return x.to(torch.float16).contiguous().view(torch.uint8).reshape(n, -1)
    levels = 127 if encoding == "int8" else 7
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / levels  # [n, h, 1]
    q = torch.round(x / scale).clamp_(-levels, levels).to(torch.int16)
    scale_bytes = scale.to(torch.float16).contiguous().view(torch.uint8)  # [n, h, 2]
    if encoding == "int8":
        body = q.to(torch.int8).view(torch.uint8)
    else:
        u = (q + 8).to(torch.uint8)  # 1..15
        body = u[..., 0::2] | (u[..., 1::2] << 4)
    return torch.cat([body, scale_bytes], dim=-1).reshape(n, -1).contiguous()


def decode(raw: torch.Tensor, heads: int, head_dim: int, encoding: str) -> torch.Tensor:
    """``uint8 [tokens, record_bytes]`` -> ``float32 [heads, tokens, head_dim]``."""
    n = raw.shape[0]
    r = raw.reshape(n, heads, -1)
    if encoding == "float16":
        return r.contiguous().view(torch.float16).to(torch.float32).transpose(0, 1)
    scale = r[..., -2:].contiguous().view(torch.float16).to(torch.float32)  # [n, h, 1]
    body = r[..., :-2]
    if encoding == "int8":
        q = body.contiguous().view(torch.int8).to(torch.float32)
    else:
        lo = (body & 0x0F).to(torch.int16) - 8
        hi = (body >> 4).to(torch.int16) - 8
        q = torch.stack((lo, hi), dim=-1).reshape(n, heads, head_dim).to(torch.float32)
    return (q * scale).transpose(0, 1)
