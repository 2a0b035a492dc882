"""Per family: layer kinds, exact reuse, the sparse path, and the bytes a request reads.

For every family in the test matrix (tiny random models built from transformers' own
configs, with each family's default window sizes), store a prefix of ``--prefix`` tokens
with ``important_ratio=1.0``, then reuse it for the prefix plus 12 new tokens:

* ``exact``: tokens and logits equal plain ``generate``;
* ``sparse``: with ``important_ratio=0.25`` (``decode="full"``) the answer's tokens equal;
* ``read_vs_all_rows``: bytes read from disk over the K/V of every stored layer's prefix
  rows (what a prefix store must keep: later prompts may match anywhere);
* ``read_vs_cache_file``: bytes read over a safetensors file of transformers' own
  ``DynamicCache`` after the prefix (which keeps only the window of sliding layers);
* hybrid families: ``state_bytes`` of the checkpoint kept after the stored prefix, over
  the K/V bytes of the same prefix (``state_vs_kv``); and the same ratio for each hybrid
  family's default (real-size) configuration, from shapes alone (a forward on the
  ``meta`` device, bf16).

    python benchmarks/model_families.py --out results/families.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).resolve().parents[1] / "tests" / "hf")]

from families import FAMILIES, STATE_FAMILIES, family_model  # noqa: E402
from helpers import run, tokens  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from impress_cache import ImpressCache, ImpressConfig, ImpressStore  # noqa: E402


def cache_file_bytes(model: torch.nn.Module, ids: torch.Tensor, where: Path) -> int:
    """Size of a safetensors file holding transformers' own cache after ``ids``."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = out.get("cache", None) or out.get("past_key_values", None)
    tensors = {}
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            tensors[f"k{i}"], tensors[f"v{i}"] = layer.keys.contiguous(), layer.values.contiguous()
    save_file(tensors, where)
    return where.stat().st_size


def one(name: str, prefix: int) -> dict:
    defaults = AutoConfig.for_model(name.split("-")[0])  # the family's own window sizes, not the tests' 8
    windows = {k: getattr(defaults, k) for k in ("sliding_window", "attention_chunk_size") if k in FAMILIES.get(name, {})}
    model = family_model(name, **windows)
    doc = tokens(1, prefix)
    prompt = torch.cat([doc, tokens(7, 12)]).unsqueeze(0)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        exact = ImpressConfig(important_ratio=1.0, chunk_tokens=16)
        with ImpressStore(d, model, exact) as store:
            run(model, doc.unsqueeze(0), cache=ImpressCache(store), new_tokens=1)
            store.flush()
            spec = store.spec
            state_bytes = store.stats()["state_bytes"]
        ref, ref_logits = run(model, prompt, new_tokens=4)
        with ImpressStore(d, model, exact) as store:
            c = ImpressCache(store)
            seq, logits = run(model, prompt, cache=c, new_tokens=4)
            read = c.stats.bytes_read_disk
        with ImpressStore(d, model, ImpressConfig(important_ratio=0.25, chunk_tokens=16)) as store:
            s = ImpressCache(store)
            sseq, _ = run(model, prompt, cache=s, new_tokens=4)
        file_bytes = cache_file_bytes(model, doc.unsqueeze(0), Path(d) / "cache.safetensors")
    itemsize = torch.empty((), dtype=spec.torch_kv_dtype).element_size()
    own = sum((i.k_heads * i.k_dim + i.v_heads * i.v_dim) * itemsize for i in spec.model_layers if i.stored) * prefix
    kinds = [i.kind for i in spec.model_layers]
    return {
        "family": name, "layers": len(kinds), "full": kinds.count("full"), "window": kinds.count("window"),
        "shared": kinds.count("shared"), "windows": sorted({i.window for i in spec.model_layers if i.kind == "window"}),
        "padded_width": bool(spec.layers) and any(spec.padded(j) for j in range(spec.num_layers)),
        "exact": bool(torch.equal(seq, ref)) and float((logits - ref_logits).abs().max()) < 1e-4,
        "sparse_answer_equal": bool(torch.equal(sseq, ref)), "sparse_loaded_tokens": s.stats.loaded_tokens,
        "bytes_read": read, "all_rows_bytes": own, "cache_file_bytes": file_bytes,
        "read_vs_all_rows": read / own, "read_vs_cache_file": read / file_bytes, "seconds": time.perf_counter() - t0,
        "state": kinds.count("state"), "hybrid": kinds.count("hybrid"), "state_bytes": state_bytes, "state_vs_kv": state_bytes / own if own else None,
    }


def default_mix(name: str, prefix: int) -> dict:
    """The family's default (real-size) configuration's layer mix, and the share of every
    layer's prefix rows a request reads at ``prefix`` tokens (window layers: their last
    ``window - 1`` rows; equal widths assumed), from the configuration alone."""
    cfg = AutoConfig.for_model(name.split("-")[0])
    n = int(cfg.num_hidden_layers)
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:
        window = getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None)
        types = ["sliding_attention" if window else "full_attention"] * n
    kinds = {"full": 0, "window": 0, "state": 0, "shared": 0}
    rows = 0
    for t in types[:n]:
        if t in ("sliding_attention", "chunked_attention"):
            w = getattr(cfg, "sliding_window", None) if t == "sliding_attention" else getattr(cfg, "attention_chunk_size", None)
            kinds["window"] += 1
            rows += min(prefix, int(w) - 1)
        elif t in ("linear_attention", "conv", "mamba"):
            kinds["state"] += 1
        elif t in ("moe", "mlp"):
            kinds["shared"] += 1
        else:
            kinds["full"] += 1
            rows += prefix
    stored = kinds["full"] + kinds["window"]
    return {"family": name, "layers": n, **kinds, "read_vs_all_rows": rows / (stored * prefix) if stored else None}


def real_config_state_ratio(name: str, prefix: int) -> dict:
    """A hybrid family's default configuration: bytes of one checkpoint of every state
    layer over the K/V bytes of ``prefix`` tokens (bf16), from shapes on the meta device."""
    cfg = AutoConfig.for_model(name)
    cfg.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        out = model(torch.tensor([[1, 2]], device="meta"), use_cache=True)
    cache = out.get("cache", None) or out.get("past_key_values", None)
    state = kv = 0
    for layer in cache.layers:
        if type(layer).__name__ == "LinearAttentionLayer":
            for i in range(layer.number_of_states):
                state += sum(t.numel() * 2 for t in (layer.conv_states[i], layer.recurrent_states[i]) if t is not None)
        elif getattr(layer, "keys", None) is not None:
            kv += (layer.keys.shape[1] * layer.keys.shape[3] + layer.values.shape[1] * layer.values.shape[3]) * 2
    return {"family": name, "state_bytes": state, "kv_bytes_per_token": kv, "state_vs_kv": state / (kv * prefix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--families", nargs="*", default=sorted(FAMILIES) + sorted(STATE_FAMILIES))
    ap.add_argument("--out", type=Path, default=Path("results/families.json"))
    args = ap.parse_args()
    rows = []
    for name in args.families:
        try:
            rows.append(one(name, args.prefix))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append({"family": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        r = rows[-1]
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "family"}, flush=True)
    mixes = []
    for name in args.families:
        try:
            mixes.append(default_mix(name, args.prefix))
        except Exception as exc:  # noqa: BLE001 - reported
            mixes.append({"family": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
    real = []
    for name in sorted(STATE_FAMILIES):
        try:
            real.append(real_config_state_ratio(name, args.prefix))
        except Exception as exc:  # noqa: BLE001 - reported
            real.append({"family": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
        print("default config", real[-1], flush=True)
    import transformers
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"command": "python " + " ".join(sys.argv), "prefix": args.prefix, "transformers": transformers.__version__,
         "rows": rows, "default_configs": real,
         "default_mixes": mixes}, indent=1
    ))
    print(table(rows, mixes))


def table(rows: list[dict], mixes: list[dict]) -> str:
    """The docs' table: the tiny model's run beside the default configuration's mix."""
    mix = {m["family"]: m for m in mixes}
    out = [
        "| family | tiny model: layers (full / window / shared / state / hybrid) | exact | sparse answer | read / every layer's rows "
        "| read / DynamicCache file | default config: layers (full / window / state) | read / every layer's rows |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = mix.get(r["family"], {})
        dm = ("-", "-") if "layers" not in m else (
            f"{m['layers']} ({m['full']} / {m['window']} / {m['state']})",
            "-" if m["read_vs_all_rows"] is None else f"{m['read_vs_all_rows']:.2f}",
        )
        if "error" in r:
            out.append(f"| {r['family']} | error: {r['error']} | | | | | {dm[0]} | {dm[1]} |")
            continue
        out.append(
            f"| {r['family']} | {r['layers']} ({r['full']} / {r['window']} / {r['shared']} / {r['state']} / {r.get('hybrid', 0)}) "
            f"| {'yes' if r['exact'] else 'NO'} | {'same' if r['sparse_answer_equal'] else 'differs'} "
            f"| {r['read_vs_all_rows']:.2f} | {r['read_vs_cache_file']:.2f} | {dm[0]} | {dm[1]} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
