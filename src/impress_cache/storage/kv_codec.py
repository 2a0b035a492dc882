"""Compact K/V blocks at rest (``ImpressConfig.kv_codec``): one byte per value plus a scale.

A K/V block ``[2, kv_heads, rows, head_dim]`` (K then V, in the store's dtype) is kept on
disk as ``uint8 [2, kv_heads, rows, head_dim + 4]``: for every K or V row of every head,
``head_dim`` one-byte codes followed by that row's ``float32`` scale (little endian).
Scales are per token and per head (absmax of the row over ``head_dim``), so a large
value in one token or head costs precision only there. A row of an encoded block is a
contiguous run of bytes like a row of a dense block, so blocks are read with ``preadv``
and verified by their checksum exactly as dense ones; the checksum covers these stored
bytes.

=========  ==========================================  ===============================
codec      code of value ``x`` in a row with absmax m  error bound per value
=========  ==========================================  ===============================
``int8``   ``round(x / s)``, ``s = m / 127``           ``s / 2 = m / 254``
``fp8``    ``float8_e4m3fn(x / s)``, ``s = m / 448``   ``|x| / 16`` plus ``s / 1024``
=========  ==========================================  ===============================

The bounds are of the decoded value in float32; decoding into float16 or bfloat16 adds
that dtype's rounding (half a unit in the last place).

With head_dim 64 a row takes ``68`` bytes per head and K or V instead of ``256`` in
float32 (0.27x), ``128`` in float16/bfloat16 (0.53x). Decoding writes straight into
the destination tensor (`decode_into`), in the pool dtype, so the memory tiers and
attention see ordinary dense blocks. A row of zeros is kept exactly (scale 0).
Non-finite values are not representable: NaN or infinite K/V rows decode to NaN.
Decoding costs a converting copy and a multiply per value (fp8's conversion is several
times slower than int8's on the CPU; docs/performance.md has the measured times), so a
codec pays where reads are slow.
"""

from __future__ import annotations

import torch

#: the codecs ``kv_codec`` may name (``None``: the store's dtype, bit-exact)
KV_CODECS = ("int8", "fp8")
#: bytes of a row's scale, after its codes
SCALE_BYTES = 4
_LEVELS = {"int8": 127.0, "fp8": 448.0}


def check_supported(codec: str) -> None:
    """Raise `ValueError` when this torch cannot encode ``codec`` on the CPU."""
    if codec not in _LEVELS:
        raise ValueError(f"kv_codec must be None or one of {', '.join(map(repr, KV_CODECS))}, got {codec!r}")
    if codec == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(f"kv_codec='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")
        try:
            torch.ones(2).to(torch.float8_e4m3fn).to(torch.float32)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"kv_codec='fp8': torch {torch.__version__} cannot convert float8_e4m3fn on the CPU ({exc})") from exc


def row_bytes(kv_heads: int, head_dim: int) -> int:
    """Stored bytes of one row (one token) of a K/V block, K and V of every head."""
    return 2 * kv_heads * (head_dim + SCALE_BYTES)


def _code_dtype(codec: str) -> torch.dtype:
    return torch.int8 if codec == "int8" else torch.float8_e4m3fn


def encode(kv: torch.Tensor, codec: str) -> torch.Tensor:
    """``[..., rows, head_dim]`` float K/V -> ``uint8 [..., rows, head_dim + 4]`` (CPU)."""
    levels = _LEVELS[codec]
    x = kv.detach().to("cpu", torch.float32)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = absmax / levels
    # (a zero row keeps scale 0; dividing by 1 instead leaves its codes 0)
    q = (x / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-levels, levels)
    codes = q.round_().to(torch.int8) if codec == "int8" else q.to(torch.float8_e4m3fn)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.uint8)
    out[..., : x.shape[-1]] = codes.view(torch.uint8)
    out[..., x.shape[-1] :] = scale.contiguous().view(torch.uint8)
    return out


def split(raw: torch.Tensor, head_dim: int, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an encoded tensor's codes ``[..., head_dim]`` and scales ``[..., 1]``
    (float32), without copying when ``head_dim`` is a multiple of 4."""
    codes = raw[..., :head_dim].view(_code_dtype(codec))
    scales = raw[..., head_dim:]
    if head_dim % SCALE_BYTES or raw.storage_offset() % SCALE_BYTES:
        scales = scales.contiguous()
    return codes, scales.view(torch.float32)


def decode_into(raw: torch.Tensor, out: torch.Tensor, codec: str) -> torch.Tensor:
    """Decode ``uint8 [..., rows, head_dim + 4]`` into ``out`` (``[..., rows, head_dim]``,
    any float dtype, may be a strided view of a larger tensor); returns ``out``."""
    codes, scales = split(raw, out.shape[-1], codec)
    # a converting copy, then a multiply in place: about twice as fast on the CPU as one
    # mixed-dtype multiply (and float8 takes part in no arithmetic promotion); the codes
    # are exact in every float dtype
    out.copy_(codes)
    return out.mul_(scales)


def decode(raw: torch.Tensor, head_dim: int, codec: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``uint8 [..., rows, head_dim + 4]`` -> ``[..., rows, head_dim]`` in ``dtype``."""
    out = torch.empty((*raw.shape[:-1], head_dim), dtype=dtype)
    return decode_into(raw, out, codec)
