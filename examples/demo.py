"""Demo: SmolLM2 answers questions about one long document, without and with prefix reuse.

    python examples/demo.py [--store DIR] [--max-new-tokens N] [--json results/demo.json]

1. Without reuse: every question recomputes the whole prompt (document + question).
2. With reuse: the first question computes the prompt and stores its K/V on disk; the
   next questions reuse the document's K/V from the store and compute only the question.
3. A fresh process reopens the store (its chunk files dropped from the page cache first:
   "guest-cold") and asks one more question.

Prints a table (matched / computed tokens, time to first token, bytes read, answer) and
writes it as JSON. Answers with and without reuse must be identical (important_ratio=1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.tools import drop_page_cache, load_smollm2, prefill_progress

TOPICS = ("assignment", "raise", "augassign")
QUESTIONS = (
    "According to the document, what does a raise statement without an expression do?",
    "According to the document, what is an augmented assignment statement?",
    "According to the document, what happens when a target is a star-prefixed name?",
    "According to the document, what does 'raise ... from None' do?",
)


def build_document(tok: Any, min_tokens: int = 3000) -> str:
    """Python's own documentation (pydoc_data.topics), at least ``min_tokens`` tokens."""
    from pydoc_data.topics import topics

    parts = [topics[name] for name in TOPICS]
    doc = "\n\n".join(parts)
    n = len(tok(doc)["input_ids"])
    if n < min_tokens:
        raise RuntimeError(f"document has only {n} tokens; add topics")
    return doc


def encode(tok: Any, doc: str, question: str) -> dict[str, torch.Tensor]:
    messages = [
        {"role": "system", "content": "Answer the question in one sentence using this document.\n\n" + doc},
        {"role": "user", "content": question},
    ]
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


class _FirstToken(BaseStreamer):
    """Records when generate emits its first new token."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def ask(model: Any, tok: Any, doc: str, question: str, store: ImpressStore | None, max_new: int) -> dict[str, Any]:
    ids = encode(tok, doc, question)
    streamer = _FirstToken()
    t0 = time.perf_counter()
    cache = None
    kwargs: dict[str, Any] = {}
    if store is not None:
        # binds to the prompt when generate starts: the stored prefix is found and read
        # inside generate, so TTFT still counts the lookup and the disk reads
        kwargs["cache"] = cache = ImpressCache(store)  # past_key_values= on transformers 5.23
    with torch.no_grad(), prefill_progress(model):
        out = model.generate(**ids, **kwargs, max_new_tokens=max_new, do_sample=False, streamer=streamer)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    n = int(ids["input_ids"].shape[1])
    s = cache.stats if cache is not None else None
    return {
        "question": question,
        "prompt_tokens": n,
        "matched_tokens": s.matched_tokens if s else 0,
        "computed_tokens": s.computed_tokens if s else n,
        "ttft_s": round((streamer.first or time.perf_counter()) - t0, 3),
        "bytes_read_disk": s.bytes_read_disk if s else 0,
        "load_s": round(s.load_seconds, 3) if s else 0.0,
        "answer": answer,
    }


def child(store_dir: str, question: str, max_new: int) -> None:
    model, tok = _load()
    doc = build_document(tok)
    with ImpressStore(store_dir, model, ImpressConfig(important_ratio=1.0)) as store:
        row = ask(model, tok, doc, question, store, max_new)
    print(json.dumps(row))


def _load() -> tuple[Any, Any]:
    print("Loading SmolLM2-135M-Instruct (about 15-30 s)...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model, tok = load_smollm2()
    print(f"Loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    # one short generate so that first-call costs do not land in the first measured request
    with torch.no_grad():
        model.generate(**tok("Hello", return_tensors="pt"), max_new_tokens=2, do_sample=False)
    return model, tok


def table(rows: list[dict[str, Any]]) -> str:
    head = "| run | matched | computed | TTFT (s) | read from disk | same answer | answer |"
    lines = [head, "|---|---:|---:|---:|---:|:---:|---|"]
    for r in rows:
        ans = r["answer"].replace("|", "\\|").replace("\n", " ")
        if len(ans) > 90:
            ans = ans[:87] + "..."
        same = {True: "yes", False: "NO", None: ""}[r.get("same_as_no_reuse")]
        lines.append(
            f"| {r['run']} | {r['matched_tokens']} | {r['computed_tokens']} | {r['ttft_s']:.2f} "
            f"| {r['bytes_read_disk'] / 2**20:.1f} MiB | {same} | {ans} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", help="store directory (default: a new temporary directory)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", default="results/demo.json", help="where to write the rows")
    p.add_argument("--child", nargs=2, metavar=("STORE", "QUESTION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.child:
        child(args.child[0], args.child[1], args.max_new_tokens)
        return 0

    model, tok = _load()
    doc = build_document(tok)
    print(f"Document: {len(tok(doc)['input_ids'])} tokens of pydoc_data.topics {TOPICS}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    reference: dict[str, str] = {}
    for i, q in enumerate(QUESTIONS):
        print(f"[no reuse] question {i + 1}/{len(QUESTIONS)}", file=sys.stderr, flush=True)
        r = ask(model, tok, doc, q, None, args.max_new_tokens)
        reference[q] = r["answer"]
        rows.append({"run": f"no reuse, Q{i + 1}", **r, "same_as_no_reuse": None})

    tmp = None
    if args.store:
        store_dir = Path(args.store)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="impress-demo-")
        store_dir = Path(tmp.name)
    with ImpressStore(store_dir, model, ImpressConfig(important_ratio=1.0)) as store:
        for i, q in enumerate(QUESTIONS[:-1]):
            print(f"[reuse] question {i + 1}", file=sys.stderr, flush=True)
            r = ask(model, tok, doc, q, store, args.max_new_tokens)
            rows.append({"run": f"reuse, Q{i + 1}", **r, "same_as_no_reuse": r["answer"] == reference[q]})
    drop_page_cache(store_dir)
    q = QUESTIONS[-1]
    print("[reuse] fresh process reopens the store (guest-cold chunk files)", file=sys.stderr, flush=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(store_dir), q, "--max-new-tokens", str(args.max_new_tokens)],
        stdout=subprocess.PIPE, text=True, check=True,
    )
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    rows.append({"run": f"reuse, fresh process, Q{len(QUESTIONS)}", **r, "same_as_no_reuse": r["answer"] == reference[q]})

    print()
    print(table(rows))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)",
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "note": "TTFT = wall time from request start (cache lookup + disk reads) to the first new token",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}", file=sys.stderr)
    if tmp is not None:
        tmp.cleanup()
    ok = all(r["same_as_no_reuse"] for r in rows if r["same_as_no_reuse"] is not None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
