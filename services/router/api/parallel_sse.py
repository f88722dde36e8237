"""The SSE response of a request with n > 1 (parallel.py): its choices' chunks interleaved as
their tokens arrive, each with its `index`, as vLLM streams them; each choice ends with its
own finish chunk, the last one carrying the `pdd` summary and the summed usage. One choice
failing ends the stream with the error (the others are abandoned). No event ids: such a
stream is not resumed (Last-Event-ID is for one choice)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..core.errors import APIError
from ..core.request_stream import Delta, RequestStream
from ..service import RouterCore
from .detokenizer import Detokenizer
from .parallel import merged_usage
from .responses import OutputOptions, SSEChunks, _texts, count, openai_reason, pdd_summary

CANCEL_WAIT_S = 5.0  # for a cancelled choice's reader to run its cleanup
DONE = object()  # a choice's reader ran to its end


class ParallelSSEResponse(StreamingResponse):
    """Releases every choice's stream however the response ends."""

    def __init__(
        self,
        core: RouterCore,
        streams: list[RequestStream],
        detoks: list[Detokenizer],
        opts: OutputOptions,
        headers: dict,
    ):
        super().__init__(
            sse_parallel(core, streams, detoks, opts), media_type="text/event-stream", headers=headers
        )
        self.core, self.streams = core, streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            for stream in self.streams:
                self.core.release(stream)


async def _read(
    core: RouterCore, stream: RequestStream, detok: Detokenizer, i: int, queue: asyncio.Queue
) -> None:
    """One choice's (text, delta, finish) items into the queue, then DONE or its error."""
    try:
        async with aclosing(_texts(core, stream, detok)) as texts:
            async for item in texts:
                await queue.put((i, item))
        await queue.put((i, DONE))
    except Exception as e:  # (its deltas() bounds every wait: an error, not silence, ends it)
        await queue.put((i, e if isinstance(e, APIError) else APIError(f"choice {i} failed: {e}", 500)))


def usage_of(streams: list[RequestStream], detoks: list[Detokenizer]) -> dict:
    return merged_usage(len(streams[0].prompt_ids), [len(d.tokens) for d in detoks])


async def sse_parallel(
    core: RouterCore, streams: list[RequestStream], detoks: list[Detokenizer], opts: OutputOptions
) -> AsyncIterator[bytes]:
    n = len(streams)
    public_id = streams[0].rid
    chunks = [
        SSEChunks(s, opts, core.served_model_name, d.tokenizer, public_id, index=i)
        for i, (s, d) in enumerate(zip(streams, detoks, strict=True))
    ]
    queue: asyncio.Queue = asyncio.Queue()
    readers = [
        asyncio.create_task(_read(core, s, d, i, queue))
        for i, (s, d) in enumerate(zip(streams, detoks, strict=True))
    ]
    role, echo = [opts.chat] * n, [opts.echo] * n
    reasons: list[str | None] = [None] * n
    last: list[tuple[str, Delta] | None] = [None] * n
    counted: set[int] = set()  # the choices counted as ended
    try:
        left = n
        while left:
            i, item = await queue.get()
            if isinstance(item, APIError):
                raise item
            if item is DONE:  # the choice's end chunk; the last one also says how it all went
                left -= 1
                if role[i]:
                    yield chunks[i].role()
                count(core, streams[i], "ok", openai_reason(reasons[i]))
                counted.add(i)
                text, delta = last[i] or ("", Delta([]))
                extra = None if left else {"pdd": pdd_summary(streams), "usage": usage_of(streams, detoks)}
                reason = openai_reason(reasons[i])
                yield chunks[i].tokens(text + detoks[i].flush(), delta.tokens, delta.logprobs, reason, extra)
                continue
            text, delta, reasons[i] = item
            if echo[i] is not None:
                yield chunks[i].echo(echo[i] or "")
                echo[i] = None
            if role[i] and (text or delta.tokens):
                yield chunks[i].role()
                role[i] = False
            if reasons[i] is not None:
                last[i] = text, delta
            elif (text or delta.tokens) and (chunk := chunks[i].tokens(text, delta.tokens, delta.logprobs)):
                yield chunk
        if opts.include_usage:
            yield chunks[0].usage(usage_of(streams, detoks))
    except APIError as e:
        for i in set(range(n)) - counted:  # a choice that already ended keeps its count
            count(core, streams[i], "error", "error")
            counted.add(i)
        yield f"data: {json.dumps(e.body())}\n\n".encode()
    finally:
        await _settle(core, streams, counted, readers)
    yield b"data: [DONE]\n\n"


async def _settle(core: RouterCore, streams: list[RequestStream], counted: set[int], readers) -> None:
    """A choice not counted yet ended because the client left (the body is closed at a yield);
    the readers still running are cancelled, their ends awaited for a bounded time."""
    for i in set(range(len(streams))) - counted:
        count(core, streams[i], "abort", "abort")
    pending = [r for r in readers if not r.done()]
    for reader in pending:
        reader.cancel()
    if pending:
        await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
