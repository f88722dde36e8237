"""The two ways a completion goes back to the client: one JSON body, or SSE chunks ending
with `data: [DONE]`. Both carry the `pdd` summary and usage."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from shared.engine.logprobs import TokenLogprobs
from shared.telemetry import metrics

from ..adapter import request_metrics
from ..core.errors import APIError
from ..core.request_stream import Delta, RequestStream
from ..service import RouterCore
from .detokenizer import Detokenizer
from .logprobs_format import LogprobsFormatter, prompt_entries
from .openai_request import ParsedRequest
from .resume import EventId, Progress, Replay
from .schemas import ChatCompletionRequest
from .tool_parsers import finish_reason
from .tool_request import ToolMode
from .tool_stream import ToolStream

Logprobs = list[TokenLogprobs | None]


@dataclass(frozen=True)
class OutputOptions:
    """What the client asked to get back beyond the text."""

    chat: bool
    logprobs: bool = False
    echo: str | None = None  # completions with echo: the prompt's text, put before the output
    include_usage: bool = False  # streams: a last chunk with `choices: []` and the usage
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` list in the body
    tools: ToolMode | None = None  # chat: the tools, and how the output is read for calls


def output_options(parsed: ParsedRequest, tokenizer) -> OutputOptions:
    body, chat = parsed.body, isinstance(parsed.body, ChatCompletionRequest)
    echo = None
    if not isinstance(body, ChatCompletionRequest) and body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(parsed.prompt_ids)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    asked = body.prompt_logprobs is not None
    return OutputOptions(chat, parsed.params.logprobs is not None, echo, include_usage, asked, parsed.tools)


def echo_logprobs(stream: RequestStream) -> Logprobs:
    return prompt_entries(len(stream.prompt_ids), stream.prompt_logprobs)


def count(core: RouterCore, stream: RequestStream, outcome: str, finished_reason: str) -> None:
    """One choice ended: pdd's count by outcome, vLLM's by finish reason (stop, length,
    abort: the client left, error) with its tokens and end-to-end latency."""
    if outcome != "abort":  # (pdd's count leaves out the requests whose client left)
        metrics.REQUESTS.labels(pipeline=stream.pipeline.value, outcome=outcome).inc()
    core.vllm.finished(request_metrics.finished(stream, finished_reason, time.monotonic()))


def openai_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def pdd_summary(streams: list[RequestStream]) -> dict:
    """The first choice's summary; with n > 1, every choice's too (`choices`)."""
    summary = streams[0].summary()
    if len(streams) > 1:
        summary["choices"] = [s.summary() for s in streams]
    return summary


def usage(stream: RequestStream, completion_tokens: int) -> dict:
    prompt = len(stream.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


class SSEChunks:
    """Formats one stream's SSE chunks (completion or chat)."""

    def __init__(
        self,
        stream: RequestStream,
        opts: OutputOptions,
        model: str,
        tokenizer,
        public_id: str | None = None,
        index: int = 0,
    ):
        self.stream, self.chat, self.model, self.index = stream, opts.chat, model, index
        self.id = public_id or stream.rid  # a resumed stream keeps the id its client knows
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if opts.chat else "text_completion"
        self.logprobs = LogprobsFormatter(tokenizer, opts.chat) if opts.logprobs else None
        tools = opts.tools if opts.chat and opts.tools is not None and opts.tools.parses else None
        self.tools = tools  # a chat choice read for tool calls as it streams
        self.tool_stream = (
            ToolStream(tools.choice, tools.parser, tools.named, tools.parallel) if tools else None
        )

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
        return self._data([{"index": self.index, "delta": {"role": "assistant"}, "finish_reason": None}])

    def tokens(
        self,
        text: str,
        tokens: list[int],
        lps: Logprobs | None = None,
        reason: str | None = None,
        extra: dict | None = None,
    ) -> bytes:
        """A chunk of new text and the tokens (with their logprobs, when asked for) behind it;
        b"" when a chat choice read for tool calls has nothing to say yet (a tag's start held)."""
        logprobs = self.logprobs(tokens, lps or [None] * len(tokens)) if self.logprobs and tokens else None
        choice: dict = {"index": self.index, "finish_reason": reason, "logprobs": logprobs}
        if self.tool_stream is not None and self.tools is not None:
            choice["delta"] = self.tool_stream.feed(text, final=reason is not None)
            if reason is not None:
                called = self.tool_stream.called
                choice["finish_reason"] = finish_reason(self.tools.choice, called, reason, streamed=True)
            elif not choice["delta"] and logprobs is None:
                return b""
        elif self.chat:
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
            [
                {
                    "index": self.index,
                    "finish_reason": None,
                    "logprobs": logprobs,
                    "text": text,
                    "token_ids": [],
                }
            ]
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
    chunks = SSEChunks(stream, opts, core.served_model_name, detok.tokenizer, public_id)
    progress = Progress(public_id, stream.params.seed, stream.prompt_ids)
    replay = Replay(resume, progress, detok) if resume else None

    def with_id(event_id: EventId, chunk: bytes) -> bytes:
        return f"id: {event_id}\n".encode() + chunk if event_ids else chunk

    counted = False
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
                    if chunk := chunks.tokens(text, delta.tokens, delta.logprobs):
                        yield with_id(progress.event_id(), chunk)
        if role:
            yield with_id(progress.event_id(), chunks.role())
        count(core, stream, "ok", openai_reason(reason))
        counted = True
        for event_id, chunk in _end_events(stream, detok, opts, chunks, progress, reason, last):
            yield with_id(event_id, chunk)
    except APIError as e:
        count(core, stream, "error", "error")
        counted = True
        yield f"data: {json.dumps(e.body())}\n\n".encode()
    finally:
        if not counted:  # the client left (the body is closed at a yield)
            count(core, stream, "abort", "abort")
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
