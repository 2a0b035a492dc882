"""The shared tier with ``kv_codec``: encoded objects travel as they are, and only to stores
of the same codec (the codec is part of the remote namespace)."""

from __future__ import annotations

import torch

from conftest import BUCKET, VOCAB, tiny_model
from impress_cache import ImpressConfig, ImpressStore


def _cfg(server, prefix, codec):
    return ImpressConfig(chunk_tokens=16, important_ratio=1.0, fsync=False, remote_retry_s=0.5, reorg_idle_ms=None,
                         remote=f"s3://{BUCKET}/{prefix}", remote_options=server.options, kv_codec=codec)


def test_encoded_objects_reach_stores_of_the_same_codec_only(bucket, tmp_path):
    server, prefix, _ = bucket
    model = tiny_model("llama")
    toks = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    with ImpressStore(tmp_path / "a", model, _cfg(server, prefix, "int8")) as a:
        spec = a.spec
        g = torch.Generator().manual_seed(1)
        keys = [torch.randn(spec.num_kv_heads, 150, spec.head_dim, generator=g) for _ in range(spec.num_layers)]
        values = [torch.randn(spec.num_kv_heads, 150, spec.head_dim, generator=g) for _ in range(spec.num_layers)]
        a.put(toks, keys, values)
        a.flush()
        assert a.stats()["remote"]["prompts_advertised"] == 1
        here = a.load(a.match(toks, limit=149).segments)
    with ImpressStore(tmp_path / "b", model, _cfg(server, prefix, "int8")) as b:
        m = b.match(toks, limit=149)
        assert m.length == 149 and b.stats()["remote"]["bad_objects"] == 0
        there = b.load(m.segments)
        assert torch.equal(there.keys, here.keys) and torch.equal(there.values, here.values)  # the same encoded bytes
    with ImpressStore(tmp_path / "c", model, _cfg(server, prefix, None)) as c:
        assert c.match(toks, limit=149).length == 0  # another namespace: never decoded as float32
