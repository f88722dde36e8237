"""The two ways a completion goes back to the client: one JSON body, or SSE chunks ending
with `data: [DONE]`. Both carry the `pdd` summary and usage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from shared.telemetry import metrics

from .detokenizer import Detokenizer
from .errors import APIError
from .request_stream import RequestStream
from .service import RouterCore


def count(stream: RequestStream, outcome: str) -> None:
    metrics.REQUESTS.labels(pipeline=stream.pipeline.value, outcome=outcome).inc()


def openai_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def usage(stream: RequestStream, completion_tokens: int) -> dict:
    prompt = len(stream.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


async def _collect(core: RouterCore, stream: RequestStream, detok: Detokenizer) -> str | None:
    """Every token of the request into `detok`; the finish reason."""
    reason = None
    async with aclosing(core.deltas(stream)) as deltas:
        async for delta in deltas:
            detok.add(delta.tokens)
            if detok.stopped:
                return "stop"
            if delta.finished:
                reason = delta.finish_reason
    return reason


CANCEL_WAIT_S = 5.0  # for a cancelled collector to run its cleanup


async def _until_done_or_gone(request: Request, task: asyncio.Task) -> bool:
    """Wait for `task`; False (and the task cancelled) if the client disconnected first."""
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            return False
    return True


async def complete(
    request: Request, core: RouterCore, stream: RequestStream, detok: Detokenizer, chat: bool, headers: dict
) -> Response:
    task = asyncio.create_task(_collect(core, stream, detok))
    try:
        if not await _until_done_or_gone(request, task):
            return Response(status_code=499)
        finish_reason = task.result()
    except APIError as e:
        count(stream, "error")
        return JSONResponse(e.body(), status_code=e.status, headers=headers)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=CANCEL_WAIT_S)  # its deltas() frees the stream...
        core.release(stream)  # ...unless it never started
    detok.flush()
    count(stream, "ok")
    headers["x-pdd-pipeline"] = stream.pipeline.value
    choice: dict = {"index": 0, "finish_reason": openai_reason(finish_reason), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": detok.emitted}
    else:
        choice["text"] = detok.emitted
        choice["token_ids"] = detok.tokens
    body = {
        "id": stream.rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": core.model_id, "choices": [choice],
        "usage": usage(stream, len(detok.tokens)), "pdd": stream.summary(),
    }  # fmt: skip
    return JSONResponse(body, headers=headers)


class SSEChunks:
    """Formats one stream's SSE chunks (completion or chat)."""

    def __init__(self, stream: RequestStream, chat: bool, model: str):
        self.stream, self.chat, self.model = stream, chat, model
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _data(self, choice: dict, extra: dict | None = None) -> bytes:
        data = {"id": self.stream.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], **(extra or {})}  # fmt: skip
        return f"data: {json.dumps(data)}\n\n".encode()

    def role(self) -> bytes:
        return self._data({"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})

    def tokens(self, text: str, tokens: list[int], reason: str | None = None, extra: dict | None = None) -> bytes:
        choice: dict = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["delta"] = {"content": text} if text or reason is None else {}
        else:
            choice["text"], choice["token_ids"] = text, tokens
        return self._data(choice, extra)


class SSEResponse(StreamingResponse):
    """The SSE response of one stream, which it releases however the response ends: also when
    the client left before the body was ever iterated (then deltas() never ran)."""

    def __init__(self, core: RouterCore, stream: RequestStream, detok: Detokenizer, chat: bool, headers: dict):
        super().__init__(sse(core, stream, detok, chat), media_type="text/event-stream", headers=headers)
        self.core, self.stream = core, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # a started body frees the stream itself...
            self.core.release(self.stream)  # ...an unstarted one is freed here


async def sse(core: RouterCore, stream: RequestStream, detok: Detokenizer, chat: bool) -> AsyncIterator[bytes]:
    chunks = SSEChunks(stream, chat, core.model_id)
    try:
        if chat:
            yield chunks.role()
        reason = None
        async with aclosing(_texts(core, stream, detok)) as texts:  # closing this closes deltas()
            async for text, tokens, finish in texts:
                reason = finish
                if text or tokens:
                    yield chunks.tokens(text, tokens)
        tail = detok.flush()
        count(stream, "ok")
        extra = {"pdd": stream.summary(), "usage": usage(stream, len(detok.tokens))}
        yield chunks.tokens(tail, [], openai_reason(reason), extra)
    except APIError as e:
        count(stream, "error")
        yield f"data: {json.dumps(e.body())}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _texts(
    core: RouterCore, stream: RequestStream, detok: Detokenizer
) -> AsyncIterator[tuple[str, list[int], str | None]]:
    """(new text, new tokens, finish reason so far) per delta; stops at a stop string."""
    last = time.monotonic()
    async with aclosing(core.deltas(stream)) as deltas:
        async for delta in deltas:
            now = time.monotonic()
            if delta.tokens and stream.merger.next_index > len(delta.tokens):
                metrics.ITL.labels(pipeline=stream.decision.pipeline.value).observe(now - last)
            last = now
            text = detok.add(delta.tokens)
            if detok.stopped:
                yield text, delta.tokens, "stop"
                return
            yield text, delta.tokens, delta.finish_reason if delta.finished else None
