"""The routes: ``/v1/chat/completions``, ``/v1/completions`` (JSON or SSE streaming),
``/v1/models``, ``/health`` and ``/metrics``. Every error is answered in OpenAI's error
shape with a 4xx status when the request was at fault; nothing a client sends stops the
server."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from impress_cache import ImpressConfig

from .answers import AnswerMemory
from .loading import LoadedModel
from .metrics import Metrics
from .schemas import ApiError, ChatRequest, CompletionRequest, ValidationError, describe, error_body
from .tenancy import Tenants
from .worker import Event, InferenceWorker, Job, Outcome

log = logging.getLogger(__name__)

#: answer length when the request sets none (never past the model's context)
DEFAULT_MAX_TOKENS = 256


def create_app(
    loaded: LoadedModel, store_root: str | Path, config: ImpressConfig | None = None, max_open_stores: int = 8,
    default_max_tokens: int = DEFAULT_MAX_TOKENS, answer_ids: bool = False,
) -> FastAPI:
    """The FastAPI app serving ``loaded`` with the stores under ``store_root`` (one per
    tenant, `tenancy`). ``config`` defaults to exact reuse (``important_ratio=1.0``).
    ``answer_ids``: put recent answers' generated ids back in place of their re-tokenized
    text in later chat prompts (`answers.AnswerMemory`): more of each next turn matches,
    but the model then sees other token ids than a server that tokenizes the text, so
    answers can differ from such a server's. Off by default."""
    config = config if config is not None else ImpressConfig(important_ratio=1.0)
    tenants = Tenants(store_root, loaded.model, config, max_open_stores)
    metrics = Metrics(tenants)
    worker = InferenceWorker(loaded, tenants, metrics, AnswerMemory() if answer_ids else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = tenants.store(None)  # open (or create) the default store now: a bad store fails the start
        await asyncio.to_thread(worker.warm_up, store)  # before /health answers: the first request pays no set-up
        worker.start()
        log.info("serving %s from %s", loaded.model_id, store_root)
        yield
        worker.stop()
        tenants.close()

    app = FastAPI(title="impress-cache", lifespan=lifespan)
    app.state.tenants, app.state.metrics, app.state.worker = tenants, metrics, worker

    @app.middleware("http")
    async def count(request: Request, call_next: Callable[[Request], Any]) -> Response:
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": loaded.model_id, "queued": worker.pending()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await asyncio.to_thread(metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(loaded)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != loaded.model_id:
            raise _unknown_model(model_id, loaded)
        return _model_card(loaded)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = _parse(ChatRequest, await request.body(), loaded)
        if not loaded.has_chat_template:
            raise ApiError(400, f"{loaded.model_id} has no chat template; use /v1/completions", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if worker.answers is not None:
            ids = worker.answers.tokenize(loaded.tokenizer, text, messages, req.cache_salt)
        else:
            ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
        return await _answer(req, ids, chat=True, prefix="")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _parse(CompletionRequest, await request.body(), loaded)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request: send a string or a list of token ids", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(loaded.tokenizer(prompt)["input_ids"])
        else:
            vocab = loaded.model.get_input_embeddings().num_embeddings
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must lie in [0, {vocab})", "prompt")
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "prompt: the prompt is empty", "prompt")
        prefix = (prompt if isinstance(prompt, str) else loaded.tokenizer.decode(ids)) if req.echo else ""
        return await _answer(req, ids, chat=False, prefix=prefix)

    async def _answer(req: ChatRequest | CompletionRequest, ids: list[int], chat: bool, prefix: str) -> Response:
        room = loaded.context - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; {loaded.model_id} takes at most {loaded.context - 1} "
                           "with room for one generated token", "messages" if chat else "prompt", "context_length_exceeded")
        limit = req.limit()
        if limit is not None and limit > room:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({limit}) exceed the context of "
                           f"{loaded.context} tokens", "max_tokens", "context_length_exceeded")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is gone (shutdown)
                pass

        job = Job(ids, limit if limit is not None else min(default_max_tokens, room), emit, req.cache_salt,
                  req.temperature, req.top_p, req.seed, req.stop_strings())
        worker.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = _Shape(rid, loaded.model_id, chat)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_stream(events, job, shape, usage, prefix), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                kind, value = await events.get()
                if kind == "done":
                    return JSONResponse(shape.whole(prefix + value.text, value))
                if kind == "error":
                    raise value
        finally:
            job.cancelled.set()  # (nothing left to do once done; a client that left stops its generation)

    return app


class _Shape:
    """OpenAI's response objects for one request."""

    def __init__(self, rid: str, model_id: str, chat: bool) -> None:
        self.rid, self.model_id, self.chat, self.created = rid, model_id, chat, int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_id}

    def whole(self, text: str, out: Outcome) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": out.finish_reason}
            return {**self._base("chat.completion"), "choices": [choice], "usage": usage(out)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage(out)}

    def chunk(self, text: str | None, first: bool, finish: str | None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, out: Outcome) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [], "usage": usage(out)}


def usage(out: Outcome) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the store."""
    return {
        "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(events: asyncio.Queue[Event], job: Job, shape: _Shape, with_usage: bool, prefix: str) -> AsyncIterator[str]:
    """The SSE events of one request: a chunk per piece of text, a last chunk with the
    finish reason, the usage chunk if asked for, then ``[DONE]``."""
    first = True
    try:
        if prefix:
            yield _sse(shape.chunk(prefix, first, None))
            first = False
        while True:
            kind, value = await events.get()
            if kind == "delta":
                yield _sse(shape.chunk(value, first, None))
                first = False
            elif kind == "done":
                yield _sse(shape.chunk("" if first else None, first, value.finish_reason))
                if with_usage:
                    yield _sse(shape.usage_chunk(value))
                break
            else:
                log.error("streamed generation failed: %s", value)
                yield _sse(error_body(f"generation failed: {value}", "server_error"))
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


def _model_card(loaded: LoadedModel) -> dict[str, Any]:
    return {"id": loaded.model_id, "object": "model", "created": 0, "owned_by": "impress-cache",
            "context_length": loaded.context}


def _unknown_model(name: str, loaded: LoadedModel) -> ApiError:
    return ApiError(404, f"the model {name!r} does not exist; this server serves {loaded.model_id!r}", "model",
                    "model_not_found")


def _parse(kind: type[ChatRequest] | type[CompletionRequest], body: bytes, loaded: LoadedModel) -> Any:
    try:
        req = kind.model_validate_json(body)
    except ValidationError as exc:
        message, param = describe(exc)
        raise ApiError(400, message, param) from None
    if req.model != loaded.model_id:
        raise _unknown_model(req.model, loaded)
    return req
