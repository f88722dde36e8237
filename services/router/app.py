"""The router's HTTP API: OpenAI-compatible completions with SSE streaming."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.engine import SamplingParams
from shared.telemetry import metrics
from shared.telemetry.span_store import default_trace_dir, find_trace_id, load_trace
from shared.telemetry.tracing import extract
from shared.telemetry.waterfall import trace_to_json

from .detokenizer import Detokenizer
from .schemas import ChatCompletionRequest, CompletionRequest, error_body
from .service import RequestError, RequestStream, RouterCore

MAX_BODY_BYTES = 8 << 20


def chat_prompt(messages) -> str:
    """A plain, model-agnostic chat layout (checkpoint chat templates are not applied)."""
    lines = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
    return "".join(lines) + "<|assistant|>\n"


def _bad(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param=param, code=code), status_code=status)


def create_app(core_factory) -> FastAPI:
    """core_factory() -> (RouterCore, tokenizer, max_model_len); awaited at startup."""
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        core, tokenizer, max_model_len, closer = await core_factory()
        state.update(core=core, tokenizer=tokenizer, max_model_len=max_model_len)
        try:
            yield
        finally:
            await closer()

    app = FastAPI(title="pdd router", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad(_describe(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), type_="invalid_request_error"), status_code=exc.status_code
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        core: RouterCore = state["core"]
        ready = core.ready()
        ok = core.nc.is_connected and ready["prefill"] > 0 and ready["main_decode"] > 0
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "instances": ready}, status_code=200 if ok else 503
        )

    @app.get("/v1/models")
    async def models() -> dict:
        core: RouterCore = state["core"]
        return {"object": "list", "data": [{"id": core.model_id, "object": "model", "owned_by": "pdd"}]}

    @app.get("/v1/instances")
    async def instances() -> dict:
        """Live instances and their KV block usage, from their load reports."""
        core: RouterCore = state["core"]
        out = {}
        for svc in ("prefill", "relay", "main_decode"):
            for r in core.registry.alive(svc):
                out[f"{svc}/{r.instance}"] = {
                    "running": r.running,
                    "waiting": r.waiting,
                    "used_blocks": r.used_blocks,
                    "free_blocks": r.free_blocks,
                    "num_blocks": r.num_blocks,
                    "address": r.address,
                }
        return out

    @app.get("/v1/traces/{trace_or_request_id}")
    async def get_trace(trace_or_request_id: str) -> JSONResponse:
        """One request's spans from every service, both datacenters (local span store)."""
        directory = default_trace_dir()
        tid = trace_or_request_id.lower()
        if not (len(tid) == 32 and all(c in "0123456789abcdef" for c in tid)):
            tid = await asyncio.to_thread(find_trace_id, directory, trace_or_request_id)
        spans = await asyncio.to_thread(load_trace, directory, tid) if tid else []
        if not spans:
            return JSONResponse(
                error_body(f"no trace for '{trace_or_request_id}' in {directory}", type_="not_found"),
                status_code=404,
            )
        return JSONResponse(trace_to_json(spans))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool) -> Response:
        core: RouterCore = state["core"]
        tokenizer = state["tokenizer"]
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return _bad(f"request body over {MAX_BODY_BYTES} bytes", status=413)
        try:
            payload = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _bad(f"request body is not valid JSON: {e}")
        if not isinstance(payload, dict):
            return _bad("request body must be a JSON object")
        try:
            body = (
                ChatCompletionRequest.model_validate(payload)
                if chat
                else CompletionRequest.model_validate(payload)
            )
        except ValidationError as e:
            return _bad(_describe(e.errors()))
        if body.model is not None and body.model != core.model_id:
            return _bad(
                f"model '{body.model}' does not exist; this server serves '{core.model_id}'",
                param="model",
                status=404,
                code="model_not_found",
            )
        if chat:
            prompt_ids = tokenizer.encode(chat_prompt(body.messages))
        elif isinstance(body.prompt, str):
            prompt_ids = tokenizer.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
            if any(t < 0 or t >= tokenizer.vocab_size for t in prompt_ids):
                return _bad(f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        if not prompt_ids:
            return _bad("prompt is empty", param="prompt")
        max_tokens = body.max_tokens or core.settings.max_tokens_default
        limit = state["max_model_len"]
        if len(prompt_ids) + max_tokens > limit:
            return _bad(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context limit of {limit} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        params = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=max_tokens,
            stop=body.stop,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        options = body.pdd.model_dump() if body.pdd else {}
        try:
            stream = await core.open(prompt_ids, params, options, extract(dict(request.headers)))
        except RequestError as e:
            metrics.REQUESTS.labels(pipeline="none", outcome="rejected").inc()
            return JSONResponse(error_body(str(e), type_=e.type), status_code=e.status)
        headers = {"x-request-id": stream.rid, "x-pdd-pipeline": stream.decision.pipeline}
        if stream.traceparent:
            headers["traceparent"] = stream.traceparent
        detok = Detokenizer(tokenizer, params.stop)
        if body.stream:
            gen = _sse(core, stream, detok, chat, core.model_id)
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        return await _complete(request, core, stream, detok, chat, headers)

    return app


async def _complete(
    request: Request, core: RouterCore, stream: RequestStream, detok: Detokenizer, chat: bool, headers: dict
) -> Response:
    finish_reason = None

    async def collect() -> str | None:
        reason = None
        async with aclosing(core.deltas(stream)) as deltas:
            async for delta in deltas:
                detok.add(delta.tokens)
                if detok.stopped:
                    return "stop"
                if delta.finished:
                    reason = delta.finish_reason
        return reason

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        finish_reason = task.result()
    except RequestError as e:
        _count(stream, "error")
        return JSONResponse(error_body(str(e), type_=e.type), status_code=e.status, headers=headers)
    finally:
        if not task.done():
            task.cancel()
    detok.flush()
    _count(stream, "ok")
    headers["x-pdd-pipeline"] = stream.pipeline
    n_out = len(detok.tokens)
    choice: dict = {"index": 0, "finish_reason": _openai_reason(finish_reason), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": detok.emitted}
    else:
        choice["text"] = detok.emitted
        choice["token_ids"] = detok.tokens
    body = {
        "id": stream.rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": core.model_id,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(stream.prompt_ids),
            "completion_tokens": n_out,
            "total_tokens": len(stream.prompt_ids) + n_out,
        },
        "pdd": stream.summary(),
    }
    return JSONResponse(body, headers=headers)


async def _sse(
    core: RouterCore, stream: RequestStream, detok: Detokenizer, chat: bool, model: str
) -> AsyncIterator[bytes]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    last = time.monotonic()

    def chunk(text: str, tokens: list[int], reason: str | None, extra: dict | None = None) -> bytes:
        choice: dict = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["delta"] = {"content": text} if text or reason is None else {}
        else:
            choice["text"] = text
            choice["token_ids"] = tokens
        data = {"id": stream.rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if extra:
            data.update(extra)
        return f"data: {json.dumps(data)}\n\n".encode()

    try:
        if chat:
            yield f"data: {json.dumps({'id': stream.rid, 'object': obj, 'created': created, 'model': model, 'choices': [{'index': 0, 'delta': {'role': 'assistant'}, 'finish_reason': None}]})}\n\n".encode()
        reason = None
        async with aclosing(core.deltas(stream)) as deltas:
            async for delta in deltas:
                now = time.monotonic()
                if delta.tokens and stream.merger.next_index > len(delta.tokens):
                    metrics.ITL.labels(pipeline=stream.decision.pipeline).observe(now - last)
                last = now
                text = detok.add(delta.tokens)
                if text or delta.tokens:
                    yield chunk(text, delta.tokens, None)
                if detok.stopped:
                    reason = "stop"
                    break
                if delta.finished:
                    reason = delta.finish_reason
        tail = detok.flush()
        _count(stream, "ok")
        yield chunk(
            tail,
            [],
            _openai_reason(reason),
            {
                "pdd": stream.summary(),
                "usage": {
                    "prompt_tokens": len(stream.prompt_ids),
                    "completion_tokens": len(detok.tokens),
                    "total_tokens": len(stream.prompt_ids) + len(detok.tokens),
                },
            },
        )
    except RequestError as e:
        _count(stream, "error")
        yield f"data: {json.dumps(error_body(str(e), type_=e.type))}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _count(stream: RequestStream, outcome: str) -> None:
    metrics.REQUESTS.labels(pipeline=stream.pipeline, outcome=outcome).inc()


def _openai_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _describe(errors) -> str:
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)
