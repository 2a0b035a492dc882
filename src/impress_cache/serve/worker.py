"""The inference thread: requests run one at a time, in arrival order, each with an
`ImpressCache` of its tenant's store. The next turn of a conversation matches what this
one stored even while its write is in flight (the cache's lookup waits for that write,
``ImpressConfig.write_wait_s``); the store is flushed after a request's last token only
when no other request waits (writes on disk and statistics saved while the server is
idle, without holding up a queued request)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from impress_cache import ImpressCache
from impress_cache.hf.compat import CACHE_KWARG

from .loading import LoadedModel
from .metrics import Metrics, ServingTotals
from .answers import AnswerMemory
from .tenancy import Tenants, tenant_dir

log = logging.getLogger(__name__)

#: an event for the request: ("delta", str), ("done", Outcome) or ("error", Exception)
Event = tuple[str, Any]


@dataclass
class Job:
    """One generation: the prompt's token ids and how to sample."""

    ids: list[int]
    max_new_tokens: int
    emit: Callable[[Event], None]
    salt: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Outcome:
    """What a finished generation returns to the route."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    ttft: float | None


def visible_text(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` cut before the first stop string, and whether one occurred."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _held_back(text: str, stop: list[str]) -> int:
    """Characters at the end of ``text`` that may begin a stop string (not sent yet)."""
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if s.startswith(text[-n:]):
                hold = max(hold, n)
                break
    return hold


class DeltaStreamer(BaseStreamer):
    """Hands each new piece of text to ``emit`` as soon as its token is generated (no
    waiting for a word's end, unlike transformers' `TextStreamer`); text that may be a
    stop string's start, or an incomplete UTF-8 character, waits for the next token."""

    def __init__(self, tokenizer: Any, job: Job) -> None:
        self.tokenizer, self.job = tokenizer, job
        self.tokens: list[int] = []
        self.sent = 0
        self.first_token_at: float | None = None
        self._prompt_seen = False
        self.stopped = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate hands the prompt first
            self._prompt_seen = True
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.extend(int(t) for t in value.reshape(-1).tolist())
        self._send(final=False)

    def end(self) -> None:
        self._send(final=True)

    def text(self) -> tuple[str, bool]:
        return visible_text(self.tokenizer.decode(self.tokens, skip_special_tokens=True), self.job.stop)

    def _send(self, final: bool) -> None:
        if self.stopped:
            return
        text, self.stopped = self.text()
        end = len(text)
        if not final and not self.stopped:
            if text.endswith("\ufffd"):
                return
            end -= _held_back(text, self.job.stop)
        if end > self.sent:
            self.job.emit(("delta", text[self.sent:end]))
            self.sent = end


class _StopWhen(StoppingCriteria):
    """Ends generation when the client went away or a stop string was produced."""

    def __init__(self, job: Job, streamer: DeltaStreamer) -> None:
        self.job, self.streamer = job, streamer

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        done = self.job.cancelled.is_set() or self.streamer.stopped
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class InferenceWorker:
    """One thread that runs `Job`s from a queue."""

    def __init__(self, loaded: LoadedModel, tenants: Tenants, metrics: Metrics, answers: AnswerMemory | None = None) -> None:
        self.loaded, self.tenants, self.metrics = loaded, tenants, metrics
        self.totals = ServingTotals(tenants.root)
        #: recent answers' generated ids, put back in place of their text in later prompts
        #: (``--answer-ids``; None: prompts are the tokenized text, as any server's)
        self.answers = answers
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="impress-serve-inference", daemon=True)
        config = loaded.model.generation_config
        eos = config.eos_token_id if config.eos_token_id is not None else loaded.tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad = config.pad_token_id if config.pad_token_id is not None else loaded.tokenizer.pad_token_id

    def warm_up(self, store: Any) -> None:
        """Two short generations, without a cache and with an `ImpressCache` of ``store``
        that stores nothing (torch's first-call costs, the cache's hooks), so that the
        first request's time to first token is like any other's. The prompt is padding
        only: no stored prompt starts with it."""
        ids = torch.full((1, 8), self.pad if self.pad is not None else 0, dtype=torch.long, device=store.device)
        kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 2, "do_sample": False, "pad_token_id": self.pad}
        with torch.no_grad():
            self.loaded.model.generate(ids, **kwargs)
            self.loaded.model.generate(ids, **kwargs, **{CACHE_KWARG: ImpressCache(store, store_prompt=False)})

    def start(self) -> InferenceWorker:
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    def pending(self) -> int:
        return self._queue.qsize()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the running job, drop the waiting ones and end the thread."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(("error", RuntimeError("the server is shutting down")))
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            started = time.perf_counter()
            try:
                outcome, store, stats = self._run(job)
            except Exception as exc:  # noqa: BLE001 - reported to the request, the thread goes on
                log.exception("generation failed")
                job.emit(("error", exc))
                continue
            job.emit(("done", outcome))
            done = time.perf_counter()
            try:  # off the response's path, and only when idle: a queued request matches what this
                if self._queue.empty():  # one stores without it (its lookup waits for the write in flight)
                    store.flush()
            except Exception:  # noqa: BLE001
                log.exception("flushing the store at %s failed", store.path)
            log.info(
                "request: %d prompt tokens (%d cached), %d generated; waited %.3f s, first token %.3f s "
                "(cache load %.3f s, I/O wait %.3f s, prefill %.3f s), generation %.3f s, flush %.3f s",
                outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens, started - job.arrived,
                outcome.ttft or -1.0, stats.load_seconds, stats.io_wait_seconds, stats.prefill_seconds, done - started,
                time.perf_counter() - done,
            )
            self.metrics.observe(stats, outcome.prompt_tokens, outcome.completion_tokens, outcome.ttft,
                                 time.perf_counter() - job.arrived)
            name = str(tenant_dir(self.tenants.root, job.salt).relative_to(self.tenants.root))
            self.totals.add(name, outcome.prompt_tokens, outcome.cached_tokens)

    def _run(self, job: Job) -> tuple[Outcome, Any, Any]:
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        store = self.tenants.store(job.salt)
        cache = ImpressCache(store, store_answer=True)  # the next turn matches through this answer
        streamer = DeltaStreamer(tokenizer, job)
        ids = torch.tensor([job.ids], dtype=torch.long, device=store.device)
        kwargs: dict[str, Any] = {
            "input_ids": ids, "attention_mask": torch.ones_like(ids), CACHE_KWARG: cache,
            "max_new_tokens": job.max_new_tokens, "streamer": streamer, "pad_token_id": self.pad,
            "stopping_criteria": StoppingCriteriaList([_StopWhen(job, streamer)]),
        }
        if job.temperature:  # sampling; None or 0: greedy
            kwargs.update(do_sample=True, temperature=job.temperature, top_p=job.top_p or 1.0, top_k=0)
            if job.seed is not None:
                torch.manual_seed(job.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = model.generate(**kwargs)
        new = out[0, ids.shape[1]:].tolist()
        text, stopped = streamer.text()
        hit_eos = bool(new) and new[-1] in self.eos
        if self.answers is not None and not stopped:  # (a stop string cuts the text inside the ids)
            self.answers.remember(tokenizer, job.salt, text, new[:-1] if hit_eos else new)
        finish = "stop" if (stopped or hit_eos or job.cancelled.is_set()) else "length"
        ttft = streamer.first_token_at - job.arrived if streamer.first_token_at is not None else None
        stats = cache.stats
        outcome = Outcome(text, len(job.ids), len(new), stats.matched_tokens, finish, ttft)
        return outcome, store, stats
