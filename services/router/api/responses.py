"""The two ways a completion goes back to the client: one JSON body, or SSE chunks ending
with `data: [DONE]`. Both carry the `pdd` summary and usage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from shared.engine.logprobs import TokenLogprobs
from shared.telemetry import metrics

from ..core.request_stream import Delta, RequestStream
from ..service import RouterCore
from .detokenizer import Detokenizer
from .errors import APIError
from .logprobs_format import LogprobsFormatter, prompt_entries
from .openai_request import ParsedRequest
from .resume import EventId, Progress, Replay
from .schemas import ChatCompletionRequest

Logprobs = list[TokenLogprobs | None]


@dataclass(frozen=True)
class OutputOptions:
    """What the client asked to get back beyond the text."""

    chat: bool
    logprobs: bool = False
    echo: str | None = None  # completions with echo: the prompt's text, put before the output
    include_usage: bool = False  # streams: a last chunk with `choices: []` and the usage


def output_options(parsed: ParsedRequest, tokenizer) -> OutputOptions:
    body, chat = parsed.body, isinstance(parsed.body, ChatCompletionRequest)
    echo = None
    if not isinstance(body, ChatCompletionRequest) and body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(parsed.prompt_ids)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return OutputOptions(chat, parsed.params.logprobs is not None, echo, include_usage)


def echo_logprobs(stream: RequestStream) -> Logprobs:
    return prompt_entries(len(stream.prompt_ids), stream.prompt_logprobs)


def count(stream: RequestStream, outcome: str) -> None:
    metrics.REQUESTS.labels(pipeline=stream.pipeline.value, outcome=outcome).inc()


def openai_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def usage(stream: RequestStream, completion_tokens: int) -> dict:
    prompt = len(stream.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


async def _collect(core: RouterCore, stream: RequestStream, detok: Detokenizer, lps: Logprobs) -> str | None:
    """Every token of the request into `detok` (their logprobs into `lps`); the finish reason."""
    reason = None
    async with aclosing(core.deltas(stream)) as deltas:
        async for delta in deltas:
            detok.add(delta.tokens)
            lps += delta.logprobs
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
    request: Request,
    core: RouterCore,
    stream: RequestStream,
    detok: Detokenizer,
    opts: OutputOptions,
    headers: dict,
) -> Response:
    lps: Logprobs = []
    task = asyncio.create_task(_collect(core, stream, detok, lps))
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
    choice: dict = {
        "index": 0,
        "finish_reason": openai_reason(finish_reason),
        "logprobs": _body_logprobs(stream, detok, lps, opts),
    }
    if opts.chat:
        choice["message"] = {"role": "assistant", "content": detok.emitted}
    else:
        choice["text"] = (opts.echo or "") + detok.emitted
        choice["token_ids"] = detok.tokens
    body = {
        "id": stream.rid,
        "object": "chat.completion" if opts.chat else "text_completion",
        "created": int(time.time()),
        "model": core.model_id,
        "choices": [choice],
        "usage": usage(stream, len(detok.tokens)),
        "pdd": stream.summary(),
    }
    return JSONResponse(body, headers=headers)


def _body_logprobs(
    stream: RequestStream, detok: Detokenizer, lps: Logprobs, opts: OutputOptions
) -> dict | None:
    if not opts.logprobs:
        return None
    fmt = LogprobsFormatter(detok.tokenizer, opts.chat)
    if opts.echo is None:
        return fmt(detok.tokens, lps)
    return fmt(stream.prompt_ids + detok.tokens, echo_logprobs(stream) + lps)


class SSEChunks:
    """Formats one stream's SSE chunks (completion or chat)."""

    def __init__(
        self, stream: RequestStream, opts: OutputOptions, model: str, tokenizer, public_id: str | None = None
    ):
        self.stream, self.chat, self.model = stream, opts.chat, model
        self.id = public_id or stream.rid  # a resumed stream keeps the id its client knows
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if opts.chat else "text_completion"
        self.logprobs = LogprobsFormatter(tokenizer, opts.chat) if opts.logprobs else None

    def _data(self, choices: list[dict], extra: dict | None = None) -> bytes:
        data = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **(extra or {}),
        }
        return f"data: {json.dumps(data)}\n\n".encode()

    def role(self) -> bytes:
        return self._data([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])

    def tokens(
        self,
        text: str,
        tokens: list[int],
        lps: Logprobs | None = None,
        reason: str | None = None,
        extra: dict | None = None,
    ) -> bytes:
        """A chunk of new text and the tokens (with their logprobs, when asked for) behind it."""
        logprobs = self.logprobs(tokens, lps or [None] * len(tokens)) if self.logprobs and tokens else None
        choice: dict = {"index": 0, "finish_reason": reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = {"content": text} if text or reason is None else {}
        else:
            choice["text"], choice["token_ids"] = text, tokens
        return self._data([choice], extra)

    def echo(self, text: str) -> bytes:
        """Completions with echo: the prompt's text (and its tokens' logprobs) comes first."""
        logprobs = (
            self.logprobs(self.stream.prompt_ids, echo_logprobs(self.stream)) if self.logprobs else None
        )
        return self._data(
            [{"index": 0, "finish_reason": None, "logprobs": logprobs, "text": text, "token_ids": []}]
        )

    def usage(self, usage: dict) -> bytes:
        """stream_options.include_usage: OpenAI's last chunk, no choices."""
        return self._data([], {"usage": usage})


class SSEResponse(StreamingResponse):
    """The SSE response of one stream, which it releases however the response ends: also when
    the client left before the body was ever iterated (then deltas() never ran). `resume`:
    the client's Last-Event-ID, when this continues a stream it had (see resume.py)."""

    def __init__(
        self,
        core: RouterCore,
        stream: RequestStream,
        detok: Detokenizer,
        opts: OutputOptions,
        headers: dict,
        resume: EventId | None = None,
        event_ids: bool = True,
    ):
        body = sse(core, stream, detok, opts, resume, event_ids)
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.core, self.stream = core, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # a started body frees the stream itself...
            self.core.release(self.stream)  # ...an unstarted one is freed here


async def sse(
    core: RouterCore,
    stream: RequestStream,
    detok: Detokenizer,
    opts: OutputOptions,
    resume: EventId | None = None,
    event_ids: bool = True,
) -> AsyncIterator[bytes]:
    """The stream's events, each with its id (resume.py) if `event_ids`; from the client's
    Last-Event-ID on when `resume` is given (the role chunk and the echo it had already)."""
    assert stream.params is not None and stream.params.seed is not None
    public_id = resume.rid if resume else stream.rid
    chunks = SSEChunks(stream, opts, core.model_id, detok.tokenizer, public_id)
    progress = Progress(public_id, stream.params.seed, stream.prompt_ids)
    replay = Replay(resume, progress, detok) if resume else None

    def with_id(event_id: EventId, chunk: bytes) -> bytes:
        return f"id: {event_id}\n".encode() + chunk if event_ids else chunk

    try:
        if replay is not None:
            replay.check_start()
        # The chat role chunk goes out with the first token, not before it: clients (and
        # benchmarks) take the first chunk with choices for the first token.
        role = opts.chat and resume is None
        reason, echo = None, (opts.echo if resume is None else None)
        last: tuple[str, Delta] | None = None  # the finishing delta: it goes out in the end chunk
        async with aclosing(_texts(core, stream, detok, replay)) as texts:  # closing this closes deltas()
            async for text, delta, finish in texts:
                reason = finish
                if echo is not None:  # with the first tokens: the prompt's logprobs came with them
                    yield with_id(progress.event_id(), chunks.echo(echo))
                    echo = None
                if role and (text or delta.tokens):
                    yield with_id(progress.event_id(), chunks.role())
                    role = False
                if reason is not None:
                    last = text, delta
                elif text or delta.tokens:
                    progress.add(delta.tokens)
                    yield with_id(progress.event_id(), chunks.tokens(text, delta.tokens, delta.logprobs))
        if role:
            yield with_id(progress.event_id(), chunks.role())
        count(stream, "ok")
        for event_id, chunk in _end_events(stream, detok, opts, chunks, progress, reason, last):
            yield with_id(event_id, chunk)
    except APIError as e:
        count(stream, "error")
        yield f"data: {json.dumps(e.body())}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _end_events(
    stream: RequestStream,
    detok: Detokenizer,
    opts: OutputOptions,
    chunks: SSEChunks,
    progress: Progress,
    reason: str | None,
    last: tuple[str, Delta] | None,
) -> list[tuple[EventId, bytes]]:
    """The end chunk (the finishing delta's text and tokens with the finish reason, as OpenAI's
    and vLLM's streams end: no empty chunk after the last token), then the usage chunk if asked."""
    text, delta = last or ("", Delta([]))
    progress.add(delta.tokens)
    done_usage = usage(stream, len(detok.tokens))
    extra = {"pdd": stream.summary(), "usage": done_usage}
    end = chunks.tokens(text + detok.flush(), delta.tokens, delta.logprobs, openai_reason(reason), extra)
    events = [(progress.event_id("end"), end)]
    if opts.include_usage:
        events.append((progress.event_id("usage"), chunks.usage(done_usage)))
    return events


def rest_of_ended(point: EventId, prompt_tokens: int, opts: OutputOptions, model: str) -> Response:
    """A client that had every token and the last chunk (Last-Event-ID `...:end`): the usage
    chunk if it asked for one and lacks it, and the end."""
    body = b""
    if opts.include_usage and point.phase == "end":
        data = {
            "id": point.rid,
            "object": "chat.completion.chunk" if opts.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": point.sent,
                "total_tokens": prompt_tokens + point.sent,
            },
        }
        usage_id = EventId(point.rid, point.sent, point.seed, point.digest, "usage")
        body = f"id: {usage_id}\ndata: {json.dumps(data)}\n\n".encode()
    return Response(body + b"data: [DONE]\n\n", media_type="text/event-stream")


async def _texts(
    core: RouterCore, stream: RequestStream, detok: Detokenizer, replay: Replay | None = None
) -> AsyncIterator[tuple[str, Delta, str | None]]:
    """(new text, the delta, finish reason so far) per delta; stops at a stop string. With
    `replay`, the tokens the client has already are only replayed into `detok`."""
    last, seen = time.monotonic(), 0
    async with aclosing(core.deltas(stream)) as deltas:
        async for item in deltas:
            delta = replay.take(item) if replay is not None and replay.left > 0 else item
            if delta is None:
                continue
            now = time.monotonic()
            if delta.tokens and seen:  # (tokens merge as they arrive: the merger may be ahead of the client)
                metrics.ITL.labels(pipeline=stream.decision.pipeline.value).observe(now - last)
            last, seen = now, seen + len(delta.tokens)
            text = detok.add(delta.tokens)
            if detok.stopped:
                yield text, delta, "stop"
                return
            yield text, delta, delta.finish_reason if delta.finished else None
