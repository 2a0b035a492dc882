"""A chat conversation over a document, served by ``transformers serve`` (default and
``--continuous-batching``) and by ``impress-cache serve``: time to first token per turn
through the official ``openai`` client (streaming), a server restart, and 8 concurrent
clients.

    python benchmarks/chat.py --out results/chat.json                        # issue 27's configuration
    python benchmarks/chat.py --turns 4 --answer-tokens 48 --out results/chat-small.json   # reduced
    python benchmarks/chat.py --report results/chat.json                     # the markdown table of a result

The document is ~``--doc-tokens`` SmolLM2 tokens of ``pydoc_data.topics`` prose taken from
the middle of the sorted topics (held out: the other benchmarks start their prose at the
first or the middle topic of a rotation and take up to 8k tokens from there; this one
starts 3/4 of the way through). It sits in the system message; each turn asks one of
``--turns`` questions, and the server's own answer (greedy, up to ``--answer-tokens``
tokens) goes into the next turn's prompt. Every server is a subprocess on a free loopback
port with the same SmolLM2-135M-Instruct weights (the GGUF file de-quantised to a float32
model directory: `model_dir`), started and measured one
after the other (nothing else of this benchmark runs meanwhile), and killed at the end
(also on errors).

* TTFT is the time from sending the request to the first SSE chunk with text.
* ``replays``: the impress server's last turn sent ``--replays`` more times, each
  followed by the same prompt through the library call (`replays`).
* ``restart``: the impress server is stopped and started again on the same store; turn 1
  of the known conversation is sent again (then the last turn).
* ``concurrent``: ``--concurrent`` requests (the document and a different question each,
  ``--concurrent-tokens`` tokens) sent one by one, then all at once; answers of the two
  runs are compared (for impress under two tenants, so that the concurrent run does not
  reuse what the sequential run stored beyond what it stored itself).
* ``library``: each of the impress server's turns, right after the server answered it
  (the server idle), through ``ImpressCache(store)`` and ``generate`` in this process on
  a store of its own, first token only (`Library`): the streaming goal compares the
  server's first SSE chunk with it, turn by turn under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from impress_cache.serve.launch import ServerProcess, free_port, impress_serve_command
from impress_cache.tools.models import SMOLLM2_FILE, smollm2_path

SYSTEM = "You are a helpful assistant. Answer questions about the document below.\n\n"
QUESTIONS = [
    "What is the main topic of the document?",
    "Summarize the first section in two sentences.",
    "Which Python statements or keywords does the document mention?",
    "Give an example of code that the document describes.",
    "What are the rules about names that the document explains?",
    "What errors or exceptions can happen, according to the document?",
    "Explain the second part of the document to a beginner.",
    "Which parts of the document are the most important for a programmer?",
    "What would you change in the document to make it clearer?",
    "Write a short quiz question about the document and answer it.",
    "List three facts from the document.",
    "What does the last section say?",
]
CONCURRENT_QUESTIONS = [
    "What is the first word of the document?", "Name one keyword the document explains.",
    "Is the document about Python? Answer yes or no and why.", "What is the title of the first section?",
    "Give one rule from the document.", "Who would read this document?",
    "What is one example from the document?", "Describe the document in one sentence.",
    "What is the last topic of the document?", "Name two terms defined in the document.",
    "What syntax does the document show?", "What is explained in the middle of the document?",
    "Is there a warning in the document?", "What is a statement, according to the document?",
    "Which section is the longest?", "What does the document say about values?",
]


def document(tok: Any, n_tokens: int) -> str:
    """``n_tokens`` tokens of held-out ``pydoc_data.topics`` prose, as text."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    start = 3 * len(names) // 4
    text = "\n\n".join(topics[n] for n in names[start:] + names[:start])
    ids = tok(text[: n_tokens * 8], add_special_tokens=False)["input_ids"][:n_tokens]
    return tok.decode(ids)


def stream_once(client: Any, model: str, messages: list[dict], max_tokens: int, extra: dict | None) -> dict[str, Any]:
    """One streamed chat request: TTFT (first chunk with text), total time, text, usage."""
    t0 = time.perf_counter()
    first, pieces, usage = None, [], None
    kwargs: dict[str, Any] = {"stream": True, "temperature": 0, "max_tokens": max_tokens}
    if extra is not None:
        kwargs.update(extra_body=extra, stream_options={"include_usage": True})
    for chunk in client.chat.completions.create(model=model, messages=messages, **kwargs):
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
        for choice in chunk.choices or []:
            text = choice.delta.content or ""
            if text and first is None:
                first = time.perf_counter() - t0
            pieces.append(text)
    out: dict[str, Any] = {"ttft": first, "seconds": time.perf_counter() - t0, "answer": "".join(pieces)}
    if usage is not None:
        out.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   cached_tokens=usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None)
    return out


def conversation(client: Any, model: str, doc: str, turns: int, tokens: int, extra: dict | None, tok: Any,
                 label: str, library: Library | None = None) -> tuple[list[dict], list[list[dict]]]:
    """Run the conversation; returns the per-turn results and each turn's messages. With
    ``library``, each turn's prompt also goes through the library call right after the
    server answered it (the server is idle then): paired TTFTs under the same load."""
    messages = [{"role": "system", "content": SYSTEM + doc}]
    rows, prompts = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        prompts.append([dict(m) for m in messages])
        r = stream_once(client, model, messages, tokens, extra)
        r["turn"] = i + 1
        r.setdefault("prompt_tokens", len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]))
        r.setdefault("completion_tokens", len(tok(r["answer"], add_special_tokens=False)["input_ids"]))
        if r.get("cached_tokens") is not None:
            r["matched_share"] = r["cached_tokens"] / r["prompt_tokens"]
        if library is not None:
            r["library"] = library.ttft(prompts[-1])
        rows.append(r)
        messages.append({"role": "assistant", "content": r["answer"]})
        print(f"  {label} turn {i + 1}: ttft {r['ttft']:.2f} s, {r['seconds']:.1f} s, prompt {r['prompt_tokens']}, "
              f"cached {r.get('cached_tokens')}, answer {r['completion_tokens']} tokens"
              + (f", library ttft {r['library']['ttft']:.2f} s" if library is not None else ""), flush=True)
    return rows, prompts


def concurrent(client: Any, model: str, doc: str, n: int, tokens: int, salts: tuple[str, str] | None, tok: Any) -> dict[str, Any]:
    """``n`` different questions one by one, then all at once; answers compared."""
    reqs = [[{"role": "system", "content": SYSTEM + doc}, {"role": "user", "content": CONCURRENT_QUESTIONS[i % 16]}]
            for i in range(n)]
    extra = (lambda s: {"cache_salt": s}) if salts else (lambda s: None)
    seq = [stream_once(client, model, m, tokens, extra(salts[0] if salts else "")) for m in reqs]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        par = list(pool.map(lambda m: stream_once(client, model, m, tokens, extra(salts[1] if salts else "")), reqs))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in par if r["ttft"] is not None]
    differ = sum(a["answer"] != b["answer"] for a, b in zip(seq, par))
    generated = sum(r.get("completion_tokens") or len(tok(r["answer"], add_special_tokens=False)["input_ids"]) for r in par)
    return {
        "clients": n, "wall_seconds": wall, "answers_differing": differ,
        "ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p99": float(np.percentile(ttfts, 99)),
        "generated_tokens": generated, "throughput_tok_s": generated / wall,
        "sequential_seconds": sum(r["seconds"] for r in seq),
        "sequential": [{"ttft": r["ttft"], "seconds": r["seconds"]} for r in seq],
        "concurrent": [{"ttft": r["ttft"], "seconds": r["seconds"], "completion_tokens": r.get("completion_tokens")} for r in par],
        "answers": [r["answer"] for r in par],
    }


class Library:
    """The library call a server's turn is compared with: ``ImpressCache(store)`` and
    ``generate`` in this process on a store of its own (first token only)."""

    def __init__(self, path: Path, store_dir: Path) -> None:
        import torch

        from impress_cache import ImpressConfig, ImpressStore
        from impress_cache.serve.loading import load_model

        torch.set_num_threads(min(2, os.cpu_count() or 1))
        loaded = load_model(path)
        self.model, self.tok = loaded.model, loaded.tokenizer
        self.store = ImpressStore(store_dir, self.model, ImpressConfig(important_ratio=1.0))
        with torch.no_grad():  # warm up torch, as the server does before it answers
            self.model.generate(torch.tensor([[self.tok.eos_token_id] * 8]), max_new_tokens=2, do_sample=False)

    def ttft(self, messages: list[dict]) -> dict[str, Any]:
        import torch
        from transformers.generation.streamers import BaseStreamer

        from impress_cache import ImpressCache
        from impress_cache.hf.compat import CACHE_KWARG

        class Clock(BaseStreamer):
            def __init__(self) -> None:
                self.calls, self.first = 0, 0.0

            def put(self, value: Any) -> None:
                self.calls += 1
                if self.calls == 2:
                    self.first = time.perf_counter()

            def end(self) -> None:
                pass

        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([self.tok(text, add_special_tokens=False)["input_ids"]])
        clock, cache = Clock(), ImpressCache(self.store)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                streamer=clock, **{CACHE_KWARG: cache})
        self.store.flush()
        st = cache.stats
        return {"ttft": clock.first - t0, "prompt_tokens": ids.shape[1], "cached_tokens": st.matched_tokens,
                "load_seconds": st.load_seconds, "io_wait_seconds": st.io_wait_seconds, "prefill_seconds": st.prefill_seconds}

    def close(self) -> None:
        self.store.close()


def replays(client: Any, model: str, messages: list[dict], extra: dict | None, library: Library, n: int) -> dict[str, Any]:
    """The last turn's prompt ``n`` times, alternately to the server (streamed, one
    token) and to the library call: both match all but its last token, so what differs is
    the server (HTTP, the queue, SSE) alone."""
    server, lib = [], []
    for _ in range(n):
        server.append(stream_once(client, model, messages, 1, extra)["ttft"])
        lib.append(library.ttft(messages)["ttft"])
    out = {"server_ttft": server, "library_ttft": lib, "server_median": float(np.median(server)),
           "library_median": float(np.median(lib))}
    out["ratio_of_medians"] = out["server_median"] / out["library_median"]
    print(f"  replays: server median {out['server_median']:.3f} s, library median {out['library_median']:.3f} s, "
          f"ratio {out['ratio_of_medians']:.2f}", flush=True)
    return out


# -- servers -----------------------------------------------------------------------------
def model_dir(work: Path) -> Path:
    """The GGUF file de-quantised to float32 and saved as a model directory.

    ``transformers serve`` 5.24 cannot load this GGUF file itself (the config it reads
    from the file has no ``architectures``: ``TypeError`` in ``model_manager._load_model``),
    so every server here serves this directory: the same weights, loaded the same way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = work / "SmolLM2-135M-Instruct"
    if not (out / "config.json").exists():
        folder = smollm2_path()
        AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE).save_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_FILE, dtype="float32")
        model.hf_quantizer = None  # (the weights are float32 tensors already: nothing quantised is left)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(out)
    return out


def transformers_command(model: Path, port: int, continuous: bool) -> list[str]:
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--device", "cpu"]
    return cmd + (["--continuous-batching"] if continuous else [])


def run_server(kind: str, args: argparse.Namespace, doc: str, tok: Any, work: Path) -> dict[str, Any]:
    """Start one server, run the conversation (and the concurrent clients), stop it."""
    import openai

    port = free_port()
    log = work / f"{kind}.log"
    path = model_dir(work)
    if kind == "impress":
        cmd, model = impress_serve_command(path, work / "impress-stores", port, *IMPRESS_ARGS), path.name
        extra: dict | None = {}
    else:
        cmd, model, extra = transformers_command(path, port, kind == "transformers-cb"), str(path), None
    result: dict[str, Any] = {"command": " ".join(cmd)}
    server = ServerProcess(cmd, port, log)
    try:
        t0 = time.perf_counter()
        server.start(timeout=600)
        result["start_seconds"] = time.perf_counter() - t0
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        library = Library(path, work / "library-store") if kind == "impress" and not args.no_library else None
        try:
            result["turns"], prompts = conversation(client, model, doc, args.turns, args.answer_tokens, extra, tok, kind, library)
            if library is not None and args.replays:
                result["replays"] = replays(client, model, prompts[-1], extra, library, args.replays)
        finally:
            if library is not None:
                library.close()
        if args.concurrent:
            salts = ("sequential", "concurrent") if kind == "impress" else None
            result["concurrent"] = concurrent(client, model, doc, args.concurrent, args.concurrent_tokens, salts, tok)
            c = result["concurrent"]
            print(f"  {kind} {args.concurrent} clients: {c['answers_differing']} answers differ, "
                  f"{c['throughput_tok_s']:.1f} tok/s, ttft p50 {c['ttft_p50']:.2f} s p99 {c['ttft_p99']:.2f} s", flush=True)
        if kind == "impress":
            server.stop()
            t0 = time.perf_counter()
            server.start(timeout=600)
            restart = {"start_seconds": time.perf_counter() - t0}
            for name, messages in (("turn1", prompts[0]), ("last_turn", prompts[-1])):
                restart[name] = stream_once(client, model, messages, args.answer_tokens, extra)
                restart[name]["same_answer"] = restart[name]["answer"] == result["turns"][0 if name == "turn1" else -1]["answer"]
                print(f"  restarted {name}: ttft {restart[name]['ttft']:.2f} s, cached {restart[name].get('cached_tokens')} "
                      f"of {restart[name].get('prompt_tokens')}", flush=True)
            result["restart"] = restart
    finally:
        server.stop(timeout=30)
    return result


# -- goals and the table -------------------------------------------------------------------
def goals(res: dict[str, Any]) -> dict[str, Any]:
    """Issue 27's goals, for the servers the run had (ratios of TTFTs; each goal in a comment)."""
    s = res["servers"]
    out: dict[str, Any] = {}
    imp = s.get("impress")
    if not imp:
        return out
    later = range(1, len(imp["turns"]))
    if later:
        out["turns_2_on_matched_min"] = min(imp["turns"][i]["matched_share"] for i in later)  # goal >= 0.95
    for name, key in (("transformers", "tf"), ("transformers-cb", "cb")):
        other = s.get(name)
        if not other:
            continue
        if later:  # goal: <= 0.25 (tf), <= 1 (cb)
            out[f"turns_2_on_vs_{key}_max"] = max(imp["turns"][i]["ttft"] / other["turns"][i]["ttft"] for i in later)
        if key == "tf":
            out["turn1_vs_tf"] = imp["turns"][0]["ttft"] / other["turns"][0]["ttft"]  # goal <= 1.1
        if "restart" in imp:
            out[f"restart_turn1_vs_{key}"] = imp["restart"]["turn1"]["ttft"] / other["turns"][0]["ttft"]  # goal <= 0.25
    if "concurrent" in imp:
        out["concurrent_answers_differing"] = imp["concurrent"]["answers_differing"]  # goal 0
    if "library" in imp["turns"][0]:  # paired: the library call right after the server's turn
        ratios = [t["ttft"] / t["library"]["ttft"] for t in imp["turns"]]
        out["stream_vs_library_max"] = max(ratios)  # goal <= 1.1
        out["stream_vs_library_median"] = float(np.median(ratios))
    elif res.get("library"):  # (results of the first version: the library run after all servers)
        out["stream_vs_library_max"] = max(t["ttft"] / l["ttft"] for t, l in zip(imp["turns"], res["library"]))
    if "replays" in imp:
        out["stream_vs_library_replays"] = imp["replays"]["ratio_of_medians"]  # goal <= 1.1
    return out


def markdown(res: dict[str, Any]) -> str:
    s = res["servers"]
    names = [n for n in ("transformers", "transformers-cb", "impress") if n in s]
    head = {"transformers": "`transformers serve`", "transformers-cb": "`transformers serve --continuous-batching`",
            "impress": "`impress-cache serve`"}
    lines = ["| TTFT (s) per turn | " + " | ".join(str(t["turn"]) for t in s[names[0]]["turns"]) + " |",
             "|---|" + "---|" * len(s[names[0]]["turns"])]
    for n in names:
        lines.append(f"| {head[n]} | " + " | ".join(f"{t['ttft']:.2f}" for t in s[n]["turns"]) + " |")
    if "impress" in s:
        lines.append("| impress: share of the prompt matched | " + " | ".join(
            f"{t.get('matched_share', 0):.2f}" for t in s["impress"]["turns"]) + " |")
        lines.append("| prompt tokens | " + " | ".join(str(t["prompt_tokens"]) for t in s["impress"]["turns"]) + " |")
    library = [t["library"] for t in s["impress"]["turns"]] if "impress" in s and "library" in s["impress"]["turns"][0] \
        else res.get("library")
    if library:
        lines.append("| library, `ImpressCache(store)` per turn, no server | " + " | ".join(
            f"{t['ttft']:.2f}" for t in library) + " |")
    lines.append("")
    if "impress" in s and "restart" in s["impress"]:
        r = s["impress"]["restart"]
        lines.append(f"After a restart of `impress-cache serve`: turn 1 TTFT {r['turn1']['ttft']:.2f} s "
                     f"({r['turn1'].get('cached_tokens')} of {r['turn1'].get('prompt_tokens')} tokens cached), "
                     f"the last turn {r['last_turn']['ttft']:.2f} s; same answers: "
                     f"{r['turn1']['same_answer'] and r['last_turn']['same_answer']}.")
        lines.append("")
    conc = [n for n in names if "concurrent" in s[n]]
    if conc:
        c0 = s[conc[0]]["concurrent"]
        lines += [f"| {c0['clients']} concurrent clients | answers differing from sequential | throughput (tok/s) | "
                  "TTFT p50 (s) | TTFT p99 (s) | wall (s) | sequential (s) |", "|---|---|---|---|---|---|---|"]
        for n in conc:
            c = s[n]["concurrent"]
            lines.append(f"| {head[n]} | {c['answers_differing']} | {c['throughput_tok_s']:.1f} | {c['ttft_p50']:.2f} | "
                         f"{c['ttft_p99']:.2f} | {c['wall_seconds']:.1f} | {c['sequential_seconds']:.1f} |")
        lines.append("")
    lines.append("Goals: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in res["goals"].items()))
    return "\n".join(lines)


#: extra ``impress-cache serve`` arguments (``--answer-ids``)
IMPRESS_ARGS: list[str] = []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--answer-tokens", type=int, default=200)
    p.add_argument("--doc-tokens", type=int, default=3000)
    p.add_argument("--concurrent", type=int, default=8, help="clients at once (0: skip)")
    p.add_argument("--concurrent-tokens", type=int, default=64)
    p.add_argument("--servers", nargs="+", default=["transformers", "transformers-cb", "impress"],
                   choices=["transformers", "transformers-cb", "impress"])
    p.add_argument("--concurrent-servers", nargs="*", default=None, help="servers that get the concurrent clients (default: all)")
    p.add_argument("--no-library", action="store_true", help="skip the in-process library reference")
    p.add_argument("--replays", type=int, default=7, help="alternate server/library replays of the last turn (0: none)")
    p.add_argument("--out", type=Path, default=Path("results/chat.json"))
    p.add_argument("--work", type=Path, default=None, help="keep the stores and server logs here (default: a temporary directory)")
    p.add_argument("--report", type=Path, default=None, help="print the table of a result file and exit")
    p.add_argument("--answer-ids", action="store_true", help="start impress-cache serve with --answer-ids")
    args = p.parse_args(argv)
    IMPRESS_ARGS[:] = ["--answer-ids"] if args.answer_ids else []
    if args.report:
        res = json.loads(args.report.read_text())
        res["goals"] = goals(res)
        print(markdown(res))
        return 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path(), gguf_file=SMOLLM2_FILE)
    doc = document(tok, args.doc_tokens)
    res: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "conditions": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_before": os.getloadavg(),
                       "python": platform.python_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
        "doc_tokens": len(tok(doc, add_special_tokens=False)["input_ids"]),
        "servers": {},
    }
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chat-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for kind in args.servers:
            saved = args.concurrent
            if args.concurrent_servers is not None and kind not in args.concurrent_servers:
                args.concurrent = 0
            print(f"== {kind}", flush=True)
            res["servers"][kind] = run_server(kind, args, doc, tok, work)
            args.concurrent = saved
    res["conditions"]["load_after"] = os.getloadavg()
    res["conditions"]["seconds"] = time.perf_counter() - t_all
    res["goals"] = goals(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
