"""Answers benchmark: greedy answers from a sparse prefix against exact reuse, on SmolLM2
(or Gemma 3 270M, a sliding-window model: ``--model gemma3``).

    python benchmarks/answers.py --split heldout --out results/answers.json     # the reported table
    python benchmarks/answers.py --split tune --variants full full-before ...   # tuning runs
    python benchmarks/answers.py --quick --out results/answers-quick.json
    python benchmarks/answers.py --model gemma3 --lengths 4096 --variants full  # -> results/answers-gemma3.json

What users read is a greedy answer, not a teacher-forced one: once one token differs the
rest of the answer drifts. Each configuration ("variant") answers every question with
``generate`` (32 greedy tokens at most, chat template of SmolLM2-135M-Instruct; Gemma 3
270M is a base model without a chat template: ``<bos>`` + text + ``"\n\nQuestion: " +
question + "\nAnswer:"``) and is
compared with exact reuse (``important_ratio=1.0``, which the tests prove equals no
cache): first token, same-position agreement over the 32 positions (a position after
both answers ended agrees), whole-answer match, and the KL divergence of the first
step's next-token distribution (dense || variant).

Prefixes: 1k, 2k, 4k and 8k tokens (8,000: the model has 8,192 positions) of
``pydoc_data.topics`` prose and of standard-library source, two texts of each kind and
length. Three facts are planted in every text (a pass key, a city, a reviewer's name, at
depths chosen by hash), and up to 10 questions are asked of each (``--questions``): the three
facts and seven open questions about the text. One of the two texts of every kind and length is
held apart by a hash (``--split heldout``); tuning runs use the other (``--split tune``).
Each prefix is stored once (in ``--work``, kept between runs) and every question and
variant reuses it; the dense references are kept there too.

Bytes before the first token: probe copies + K/V rows of the sparse prefill + what the
uncertainty guard read, over the bytes of every K/V row of the reused prefix (what whole
prefix reuse reads; for Gemma 3, every layer's rows, although its 15 window layers of 18
never read more than their last 511 rows, exact or not). Chunk files are dropped from the page cache before every request
(guest-cold), the memory tiers are off and the background reorganiser too (every
variant reads the same layout), except in ``full-reorg``, which reorders its own copy of
each prefix (taken before any request) after every question by the store's own rules, and
``int8`` / ``fp8``, exact reuse from a copy of each prefix stored with that ``kv_codec``. TTFT is measured from ``generate`` to the
first token reaching a streamer.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG
from impress_cache.tools import drop_page_cache, load_gemma3_270m, load_smollm2

NEW_TOKENS = 32
LENGTHS = (1024, 2048, 4096, 8000)
CODE_SOURCES = (
    ("argparse.py", "textwrap.py", "dataclasses.py", "inspect.py"),
    ("tarfile.py", "typing.py", "configparser.py", "logging/__init__.py"),
)
CITIES = ("Valparaiso", "Tromso", "Cartagena", "Hobart", "Nagasaki", "Timbuktu", "Quebec", "Odessa")
NAMES = ("Amelia Hart", "Jonas Berg", "Priya Natarajan", "Tomas Ruiz", "Ingrid Holm", "Kofi Mensah")
FACT_QUESTIONS = (
    "What is the pass key mentioned in the text? Answer with the number only.",
    "Which city is named as the secret city in the text?",
    "Who reviewed this document, according to the note in the text?",
)
OPEN_QUESTIONS = {
    "prose": (
        "In two sentences, what is the text above about?",
        "Name one Python keyword or statement that the text explains.",
        "Is the text from a tutorial or from a reference manual? Explain briefly.",
        "What is the last topic discussed in the text?",
        "Summarize the first paragraph of the text in one sentence.",
        "Which example of Python code does the text give? Quote one line.",
        "What error or exception does the text mention?",
    ),
    "code": (
        "Explain in two sentences what the code above does.",
        "Which classes are defined in the code above?",
        "Name two functions defined in the code above and say what they do.",
        "What would be a good file name for the code above?",
        "Which modules does the code above import?",
        "What does the first function in the code above return?",
        "Which exception does the code above raise or handle?",
    ),
}
#: the configurations compared with dense reuse (on top of the library's defaults)
BEFORE = {"important_ratio": 0.25, "prefetch": True, "refresh_new_tokens": False, "guard_margin": 0.0}
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},  # the library's defaults (important_ratio="auto": exact or sparse per request)
    "sparse": {"important_ratio": 0.2},  # the defaults' sparse path, on every request
    "full-before": BEFORE,  # the defaults before issue 14
    "full-refresh": {"important_ratio": 0.2, "guard_margin": 0.0},  # the sparse path without the guard
    "keep": {"decode": "keep", "important_ratio": 0.25},
    # the two ways of scoring the prefix (`block_scores`), whatever the default
    "keep-rows": {"decode": "keep", "important_ratio": 0.25, "block_scores": "rows"},
    "keep-bounds": {"decode": "keep", "important_ratio": 0.25, "block_scores": "bounds"},
    "full-rows": {"block_scores": "rows"},
    "full-bounds": {"block_scores": "bounds"},
    "keep-reselect1": {"decode": "keep", "important_ratio": 0.25, "keep_reselect": 1},
    "keep-reselect1-d0": {"decode": "keep", "important_ratio": 0.25, "keep_reselect": 1, "keep_reselect_decay": 0.0},
    "keep-reselect4": {"decode": "keep", "important_ratio": 0.25, "keep_reselect": 4},
    "random-keep": {"selection": "random", "decode": "keep", "important_ratio": 0.25},
    "recent-keep": {"selection": "recent", "decode": "keep", "important_ratio": 0.25},
    "h2o-keep": {"selection": "h2o", "decode": "keep", "important_ratio": 0.25},
    # the defaults with importance reordering between questions (what the background
    # reorganiser does when the store is idle), on a copy of the stored prefix
    "full-reorg": {"important_ratio": 0.2, "reorganize": True},
    # exact reuse from a store that keeps K/V compact at rest (its own copy of each prefix,
    # stored with the codec): close to exact reuse, not bit-exact
    "int8": {"important_ratio": 1.0, "kv_codec": "int8"},
    "fp8": {"important_ratio": 1.0, "kv_codec": "fp8"},
}
DEFAULT_VARIANTS = ("full", "sparse", "full-before", "keep", "random-keep", "recent-keep", "h2o-keep")
#: the models: loader, how a prompt is framed (``chat``: the chat template; ``raw``: no
#: template), and what the result file says
MODELS: dict[str, dict[str, Any]] = {
    "smollm2": {"load": load_smollm2, "prompt": "chat",
                "about": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32), K/V stored in float32, chat template"},
    "gemma3": {"load": load_gemma3_270m, "prompt": "raw",
               "about": "Gemma 3 270M base (Q4_K_M GGUF dequantised to float32; 15 sliding-window layers of window 512, "
                        "3 global), K/V stored in float32, raw prompt (no chat template)"},
}


def digest(*parts: Any) -> int:
    return int(hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def heldout_variant(kind: str, length: int) -> int:
    """Which of the two texts of a kind and length is held apart (fixed, by hash)."""
    return digest("heldout", kind, length) % 2


# -- texts and questions ------------------------------------------------------------------
def corpus_text(kind: str, variant: int) -> str:
    if kind == "prose":
        from pydoc_data.topics import topics

        names = sorted(topics)
        off = 0 if variant == 0 else len(names) // 2
        return "\n\n".join(topics[n] for n in names[off:] + names[:off])
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((lib / name).read_text(errors="replace") for name in CODE_SOURCES[variant])


def facts(text_id: str) -> tuple[int, str, str]:
    h = digest("facts", text_id)
    return 10000 + h % 90000, CITIES[(h >> 20) % len(CITIES)], NAMES[(h >> 30) % len(NAMES)]


def prompt_frame(tok: Any, prompt: str) -> tuple[list[int], str, str]:
    """``(head ids, text before a question, text after it)``: the chat template's head and
    tail around the document (``chat``), or ``<bos>`` and ``Question: ... Answer:`` (``raw``)."""
    if prompt == "raw":
        return [tok.bos_token_id] if tok.bos_token_id is not None else [], "\n\nQuestion: ", "\nAnswer:"
    marker = "<<DOC>>"
    rendered = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    head, tail = rendered.split(marker)
    return tok(head, add_special_tokens=False)["input_ids"], "\n\n", tail


def build_text(tok: Any, kind: str, length: int, variant: int, prompt: str = "chat") -> dict[str, Any]:
    """The prefix tokens (prompt head + text with three planted facts) and the question
    suffixes of one text."""
    text_id = f"{kind}-{length}-{variant}"
    head_ids, ask, tail = prompt_frame(tok, prompt)
    key, city, name = facts(text_id)
    sentences = [
        f" The pass key is {key}. Remember it: the pass key is {key}. ",
        f" Note: the secret city is {city}. ",
        f" Note: this document was reviewed by {name}. ",
    ]
    needles = [tok(s, add_special_tokens=False)["input_ids"] for s in sentences]
    body_len = length - len(head_ids) - sum(map(len, needles))
    ids = tok(corpus_text(kind, variant), add_special_tokens=False)["input_ids"]
    start = digest("start", text_id) % max(1, len(ids) - body_len)
    body = ids[start : start + body_len]
    if len(body) < body_len:
        raise RuntimeError(f"{kind} corpus too short for {length} tokens")
    depths = sorted(0.1 + 0.8 * ((digest("depth", text_id, i) % 1000) / 1000) for i in range(3))
    out: list[int] = []
    at = 0
    for d, needle in zip(depths, needles):
        cut = int(d * body_len)
        out += body[at:cut] + needle
        at = cut
    out += body[at:]
    prefix = head_ids + out
    assert len(prefix) == length
    questions = list(FACT_QUESTIONS) + list(OPEN_QUESTIONS[kind])
    suffixes = [tok(ask + q + tail, add_special_tokens=False)["input_ids"] for q in questions]
    return {"id": text_id, "kind": kind, "length": length, "variant": variant, "prefix": prefix,
            "questions": questions, "suffixes": suffixes, "facts": [str(key), city, name]}


# -- running one request -------------------------------------------------------------------
class FirstTokenClock:
    """A streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.calls = 0
        self.ttft: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.ttft is None:  # the first call carries the prompt
            self.ttft = time.perf_counter() - self.t0

    def end(self) -> None:
        pass


@torch.no_grad()
def answer(model: Any, store: ImpressStore, ids: torch.Tensor, eos: int | None) -> dict[str, Any]:
    drop_page_cache(store.path)
    clock = FirstTokenClock()
    cache = ImpressCache(store, store_prompt=False)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, streamer=clock,
        output_logits=True, return_dict_in_generate=True, pad_token_id=eos, **{CACHE_KWARG: cache},
    )
    total = time.perf_counter() - clock.t0
    s = cache.stats
    return {
        "tokens": out.sequences[0, ids.shape[1] :].tolist(),
        "logp_first": F.log_softmax(out.logits[0][0].float(), -1),
        "ttft_s": clock.ttft,
        "total_s": total,
        "reused": cache.reused_tokens,
        "bytes_first": s.bytes_read_probe + s.bytes_read_rows + s.bytes_read_guard,
        "bytes_total": s.bytes_read_disk,
        "guard_triggered": s.guard_triggered,
        "first_token_margin": s.first_token_margin,
        "refresh_s": s.refresh_seconds,
        "fallback_layers": len(s.fallback_layers),
    }


def compare(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    a, b = ref["tokens"], got["tokens"]
    pa, pb = a + [-1] * (NEW_TOKENS - len(a)), b + [-1] * (NEW_TOKENS - len(b))
    lr, lg = ref["logp_first"], got["logp_first"]
    return {
        "first_token": float(bool(a) and bool(b) and a[0] == b[0]),
        "same_position": sum(x == y for x, y in zip(pa, pb)) / NEW_TOKENS,
        "whole_answer": float(a == b),
        "kl_first": float((lr.exp() * (lr - lg)).sum()),
    }


def kv_bytes_per_token(model: Any) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def model_tag(base: dict[str, Any]) -> str:
    """Part of the names in ``--work`` (empty for SmolLM2: work directories of earlier runs stay valid)."""
    return "" if base.get("model", "smollm2") == "smollm2" else f"{base['model']}-"


def ensure_stored(model: Any, text: dict[str, Any], work: Path, base: dict[str, Any], keep_pristine: bool) -> Path:
    """Store the text's prefix once (kept in ``work`` between runs); with
    ``keep_pristine`` also an untouched copy for the reordering variants."""
    codec = f"-{base['kv_codec']}" if base.get("kv_codec") else ""
    d = work / f"store-{model_tag(base)}c{base['chunk_tokens']}-{base['probe_dtype']}{codec}" / text["id"]
    if (d / "STORED").exists():
        return d
    t0 = time.perf_counter()
    with ImpressStore(d, model, config(base, important_ratio=1.0)) as store, torch.no_grad():
        first = torch.tensor([text["prefix"] + text["suffixes"][0][:1]])
        model(first, **{CACHE_KWARG: ImpressCache(store, first)}, use_cache=True)
        store.flush()
    if keep_pristine:  # untouched by any request (no statistics): what a reordering variant starts from
        shutil.copytree(d, pristine(d))
    (d / "STORED").write_text(f"{time.perf_counter() - t0:.1f} s\n")
    print(f"  stored {text['id']} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return d


def config(base: dict[str, Any], **over: Any) -> ImpressConfig:
    """The store's configuration: ``base`` (without its ``model`` entry) and ``over``."""
    return ImpressConfig(**{**{k: v for k, v in base.items() if k != "model"}, **over})


def pristine(store_dir: Path) -> Path:
    return store_dir.with_name(store_dir.name + ".pristine")


def reorg_copy(store_dir: Path, work: Path, name: str) -> Path:
    """A fresh copy of a stored prefix for a variant that reorders it, taken before any
    request (the shared copy keeps prompt order and gathers every variant's statistics,
    which would leak later questions' importance into the reordering)."""
    if not pristine(store_dir).exists():
        raise SystemExit(f"{store_dir} has no untouched copy (stored by an older answers.py): use a new --work")
    d = work / "reorg" / name / store_dir.name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(pristine(store_dir), d)
    return d


def reference(model: Any, text: dict[str, Any], qi: int, store_dir: Path, work: Path, base: dict[str, Any], eos: int | None) -> dict[str, Any]:
    """Dense reuse's answer (cached in ``work``)."""
    f = work / "refs" / f"{model_tag(base)}{text['id']}-q{qi}-c{base['chunk_tokens']}.pt"
    if f.exists():
        return torch.load(f)
    ids = torch.tensor([text["prefix"] + text["suffixes"][qi]])
    with ImpressStore(store_dir, model, config(base, important_ratio=1.0)) as store:
        ref = answer(model, store, ids, eos)
    f.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ref, f)
    return ref


# -- summary -----------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["variant_name"], r["length"]), []).append(r)
    out: dict[str, Any] = {}
    for (name, length), rs in sorted(groups.items()):
        n = len(rs)
        out.setdefault(name, {})[str(length)] = {
            "n": n,
            "first_token": sum(r["first_token"] for r in rs) / n,
            "same_position": sum(r["same_position"] for r in rs) / n,
            "whole_answer": sum(r["whole_answer"] for r in rs) / n,
            "kl_first": sum(r["kl_first"] for r in rs) / n,
            "bytes_first_vs_whole": sum(r["bytes_first_vs_whole"] for r in rs) / n,
            "bytes_total_vs_whole": sum(r["bytes_total_vs_whole"] for r in rs) / n,
            "total_median_s": statistics.median(r["total_s"] for r in rs),
            "guard_rate": sum(r["guard_triggered"] > 0 for r in rs) / n,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
            "ttft_dense_median_s": statistics.median(r["ttft_dense_s"] for r in rs),
            "refresh_median_s": statistics.median(r["refresh_s"] for r in rs),
        }
    return out


def goals(summary: dict[str, Any]) -> dict[str, Any]:
    g: dict[str, Any] = {}
    full = summary.get("full", {})
    for length, v in full.items():
        g[f"full@{length}"] = {
            "first_token>=0.98": (round(v["first_token"], 3), v["first_token"] >= 0.98),
            "same_position>=0.90": (round(v["same_position"], 3), v["same_position"] >= 0.90),
            "bytes_first<=0.40": (round(v["bytes_first_vs_whole"], 3), v["bytes_first_vs_whole"] <= 0.40),
        }
    for name in ("keep", "keep-reselect1"):
        keep = summary.get(name, {}).get("2048")
        if keep:
            g[f"{name}@2048"] = {"same_position>=0.85": (round(keep["same_position"], 3), keep["same_position"] >= 0.85)}
    for length, v in summary.get("int8", {}).items():  # compact K/V at rest against float32 reuse
        g[f"int8@{length}"] = {"same_position>=0.97": (round(v["same_position"], 3), v["same_position"] >= 0.97)}
    return g


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        "| variant | prefix | n | first token | same-position (32) | whole answer | first-step KL | bytes before 1st token / whole | guard rate | TTFT median (s) | TTFT dense (s) | bytes in all / whole | answer time median (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in result["meta"]["variants"]:
        for length, v in sorted(s.get(name, {}).items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {name} | {length} | {v['n']} | {v['first_token']:.3f} | {v['same_position']:.3f} | {v['whole_answer']:.3f} "
                f"| {v['kl_first']:.4f} | {v['bytes_first_vs_whole']:.3f} | {v['guard_rate']:.2f} | {v['ttft_median_s']:.2f} "
                f"| {v['ttft_dense_median_s']:.2f} | {v.get('bytes_total_vs_whole', float('nan')):.2f} "
                f"| {v.get('total_median_s', float('nan')):.2f} |"
            )
    return "\n".join(lines)


def merge(results: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """One result from runs over different lengths (or variants); written to ``out``."""
    rows = [r for res in results for r in res["rows"]]
    names = list(dict.fromkeys(n for res in results for n in res["meta"]["variants"]))
    meta = {**results[0]["meta"], "variants": names, "command": [res["meta"]["command"] for res in results],
            "seconds": sum(res["meta"]["seconds"] for res in results),
            "partial": any(res["meta"].get("partial") for res in results)}
    summary = summarize(rows)
    merged = {"meta": meta, "summary": summary, "goals": goals(summary), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2, default=str))
    return merged


def parse_variants(names: list[str]) -> dict[str, dict[str, Any]]:
    """Names from `VARIANTS`, or ``name:key=value,key=value`` for an ad-hoc one."""
    out = {}
    for spec in names:
        if ":" not in spec:
            out[spec] = VARIANTS[spec]
            continue
        name, kvs = spec.split(":", 1)
        cfg: dict[str, Any] = {}
        for kv in kvs.split(","):
            k, v = kv.split("=")
            cfg[k] = json.loads(v) if v not in ("full", "keep", "block", "token", "random", "recent", "h2o", "next", "agreed", "rows", "bounds") else v
        out[name] = cfg
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--out", default=None, help="default: results/answers.json (results/answers-MODEL.json for another model)")
    p.add_argument("--split", choices=["heldout", "tune", "both"], default="heldout")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--kinds", nargs="+", default=["prose", "code"])
    p.add_argument("--questions", type=int, default=10, help="questions per text (at most 10: 20 per length)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    p.add_argument("--work", default=None,
                   help="directory for the stored prefixes and dense references, kept for later runs "
                        "(default: a temporary directory removed at the end)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="1k and 2k, 4 questions per text, variants full and keep")
    p.add_argument("--prepare", action="store_true", help="only store the prefixes and compute the dense answers")
    p.add_argument("--report", metavar="JSON", nargs="+",
                   help="print the Markdown table of earlier runs and exit; several runs (e.g. one per length) are merged into --out")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = "results/answers.json" if args.model == "smollm2" else f"results/answers-{args.model}.json"
    if args.report:
        results = [json.loads(Path(f).read_text()) for f in args.report]
        if len(results) == 1:  # summaries recomputed from the rows (older files lack some columns)
            summary = summarize(results[0]["rows"])
            result = {**results[0], "summary": summary, "goals": goals(summary)}
        else:
            result = merge(results, Path(args.out))
        print(markdown(result))
        print(json.dumps(result["goals"], indent=1))
        return 0
    if args.prepare and not args.work:
        p.error("--prepare stores prefixes for later runs: give --work DIR")
    if args.quick:
        args.lengths, args.questions, args.variants = [1024, 2048], 4, ["full", "keep"]
    variants = {} if args.prepare else parse_variants(args.variants)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = MODELS[args.model]["load"]()
    eos = tok.eos_token_id
    # no memory tiers (every request reads from disk), no background reorganisation (the
    # stored layout stays the same for every variant)
    base = dict(chunk_tokens=ImpressConfig().chunk_tokens, probe_dtype="int4", device_bytes=0, host_bytes=0, reorg_idle_ms=None,
                model=args.model)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="impress-answers-"))
    if not args.work:
        atexit.register(shutil.rmtree, work, True)
    per_token = kv_bytes_per_token(model)
    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        for kind in args.kinds:
            held = heldout_variant(kind, length)
            texts = {"heldout": [held], "tune": [1 - held], "both": [0, 1]}[args.split]
            for tv in texts:
                text = build_text(tok, kind, length, tv, MODELS[args.model]["prompt"])
                store_dir = ensure_stored(model, text, work, base, any("reorganize" in v for v in variants.values()))
                refs = [reference(model, text, qi, store_dir, work, base, eos) for qi in range(args.questions)]
                for name, over in variants.items():
                    over = dict(over)
                    reorg = bool(over.pop("reorganize", False))
                    conf = config(base, **over)
                    rewritten = 0
                    run_dir = reorg_copy(store_dir, work, name) if reorg else store_dir
                    if over.get("kv_codec"):  # the prefix stored with the codec, once
                        run_dir = ensure_stored(model, text, work, {**base, "kv_codec": over["kv_codec"]}, False)
                    with ImpressStore(run_dir, model, conf) as store:
                        for qi in range(args.questions):
                            ids = torch.tensor([text["prefix"] + text["suffixes"][qi]])
                            got = answer(model, store, ids, eos)
                            row = {
                                "variant_name": name, "text": text["id"], "kind": kind, "length": length,
                                "split": "heldout" if tv == held else "tune", "question": qi,
                                **compare(refs[qi], got),
                                "bytes_first_vs_whole": got["bytes_first"] / (got["reused"] * per_token),
                                "bytes_total_vs_whole": got["bytes_total"] / (got["reused"] * per_token),
                                "ttft_s": got["ttft_s"], "ttft_dense_s": refs[qi]["ttft_s"], "total_s": got["total_s"],
                                "guard_triggered": got["guard_triggered"], "first_token_margin": got["first_token_margin"],
                                "refresh_s": got["refresh_s"], "fallback_layers": got["fallback_layers"],
                                "answer": tok.decode(got["tokens"], skip_special_tokens=True),
                                "dense_answer": tok.decode(refs[qi]["tokens"], skip_special_tokens=True),
                                "reordered_before": rewritten,
                            }
                            rows.append(row)
                            if reorg:  # as the idle reorganiser would, by the store's own rules
                                rewritten += store.reorganize()["rewritten"]
                    if reorg:
                        shutil.rmtree(run_dir, ignore_errors=True)
                    done = [r for r in rows if r["variant_name"] == name and r["text"] == text["id"]]
                    print(
                        f"{text['id']:>16} {name:>14}: first {sum(r['first_token'] for r in done)}/{len(done)} "
                        f"same-pos {sum(r['same_position'] for r in done) / len(done):.3f} "
                        f"bytes {sum(r['bytes_first_vs_whole'] for r in done) / len(done):.3f}",
                        file=sys.stderr, flush=True,
                    )
                write(args, argv, variants, rows, t0, partial=True)
    result = write(args, argv, variants, rows, t0, partial=False)
    print(markdown(result))
    print(json.dumps(result["goals"], indent=1))
    print(f"wrote {args.out} in {result['meta']['seconds']} s", file=sys.stderr)
    return 0


def write(args: Any, argv: list[str] | None, variants: dict[str, Any], rows: list[dict[str, Any]], t0: float, partial: bool) -> dict[str, Any]:
    """Write the result file (also after every text, marked partial)."""
    summary = summarize(rows)
    result = {
        "meta": {
            "command": "python benchmarks/answers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": MODELS[args.model]["about"],
            "split": args.split,
            "variants": list(variants),
            "variant_configs": variants,
            "defaults": ImpressConfig().to_dict(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, torch threads {torch.get_num_threads()}",
            "disk": "guest-cold chunk files (POSIX_FADV_DONTNEED before every request), memory tiers off",
            "seconds": round(time.perf_counter() - t0, 1),
            "partial": partial,
        },
        "summary": summary,
        "goals": goals(summary),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    sys.exit(main())
