"""A completion as one JSON body: the request's choices (one per child of a request with
n > 1, see parallel.py), each read whole, with the `pdd` summary and the usage. A chat choice
under tools has its calls parsed out of the text (tool_parsers.py)."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..core.errors import APIError
from ..core.request_stream import RequestStream
from ..service import RouterCore
from .detokenizer import Detokenizer
from .logprobs_format import LogprobsFormatter, vllm_prompt_logprobs
from .parallel import merged_usage
from .responses import Logprobs, OutputOptions, count, echo_logprobs, openai_reason, pdd_summary
from .tool_parsers import call_id, finish_reason, parse_output
from .tool_request import ToolMode

CANCEL_WAIT_S = 5.0  # for a cancelled collector to run its cleanup


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


async def _until_done_or_gone(request: Request, waited: asyncio.Future) -> bool:
    """Wait for `waited`; False (and it cancelled) if the client disconnected first."""
    while not waited.done():
        done, _ = await asyncio.wait({waited}, timeout=0.5)
        if not done and await request.is_disconnected():
            waited.cancel()
            return False
    return True


def chat_message(tools: ToolMode | None, text: str, reason: str) -> tuple[dict, str]:
    """The assistant message of a chat choice and its finish reason."""
    if tools is None or not tools.parses:
        return {"role": "assistant", "content": text}, reason
    parsed = parse_output(tools.choice, tools.parser, text, tools.named)
    calls = parsed.calls if tools.parallel else parsed.calls[:1]
    message: dict = {"role": "assistant", "content": parsed.content}
    if calls:
        message["tool_calls"] = [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message, finish_reason(tools.choice, bool(calls), reason)


async def complete(
    request: Request,
    core: RouterCore,
    streams: list[RequestStream],
    detoks: list[Detokenizer],
    opts: OutputOptions,
    headers: dict,
) -> Response:
    """Every choice read whole; one failing fails the request (the others are abandoned)."""
    lps: list[Logprobs] = [[] for _ in streams]
    tasks = [
        asyncio.create_task(_collect(core, s, d, lp)) for s, d, lp in zip(streams, detoks, lps, strict=True)
    ]
    together = asyncio.gather(*tasks)
    try:
        if not await _until_done_or_gone(request, together):
            for stream in streams:
                count(core, stream, "abort", "abort")
            return Response(status_code=499)
        reasons = together.result()
    except APIError as e:
        for stream in streams:
            count(core, stream, "error", "error")
        return JSONResponse(e.body(), status_code=e.status, headers=headers)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=CANCEL_WAIT_S)  # their deltas() free the streams...
        for stream in streams:
            core.release(stream)  # ...unless one never started
        if together.done() and not together.cancelled():
            together.exception()  # (retrieved: one failure is the answer)
    for stream, reason in zip(streams, reasons, strict=True):
        count(core, stream, "ok", openai_reason(reason))
    first = streams[0]
    headers["x-pdd-pipeline"] = first.pipeline.value
    choices = [
        _choice(i, s, d, lp, r, opts)
        for i, (s, d, lp, r) in enumerate(zip(streams, detoks, lps, reasons, strict=True))
    ]
    body = {
        "id": first.rid,
        "object": "chat.completion" if opts.chat else "text_completion",
        "created": int(time.time()),
        "model": core.served_model_name,
        "choices": choices,
        "usage": merged_usage(len(first.prompt_ids), [len(d.tokens) for d in detoks]),
        "pdd": pdd_summary(streams),
    }
    if opts.prompt_logprobs:  # vLLM's place: the choice of a completion, the body of a chat
        entries = vllm_prompt_logprobs(detoks[0].tokenizer, first.prompt_ids, echo_logprobs(first))
        for choice in [body] if opts.chat else choices:
            choice["prompt_logprobs"] = entries
    return JSONResponse(body, headers=headers)


def _choice(
    index: int,
    stream: RequestStream,
    detok: Detokenizer,
    lps: Logprobs,
    reason: str | None,
    opts: OutputOptions,
) -> dict:
    detok.flush()
    choice: dict = {
        "index": index,
        "finish_reason": openai_reason(reason),
        "logprobs": _body_logprobs(stream, detok, lps, opts),
    }
    if opts.chat:
        choice["message"], choice["finish_reason"] = chat_message(
            opts.tools, detok.emitted, choice["finish_reason"]
        )
    else:
        choice["text"] = (opts.echo or "") + detok.emitted
        choice["token_ids"] = detok.tokens
    return choice


def _body_logprobs(
    stream: RequestStream, detok: Detokenizer, lps: Logprobs, opts: OutputOptions
) -> dict | None:
    if not opts.logprobs:
        return None
    fmt = LogprobsFormatter(detok.tokenizer, opts.chat)
    if opts.echo is None:
        return fmt(detok.tokens, lps)
    return fmt(stream.prompt_ids + detok.tokens, echo_logprobs(stream) + lps)
