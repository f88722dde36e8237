"""Logprobs and stream options as the router reads and writes them: the request's counts and
their 400s, the merger keeping each token's logprobs with it, and OpenAI's two formats
(legacy completions with echo, chat), in bodies and stream chunks, plus include_usage."""

from __future__ import annotations

import json

import pytest

from services.router.api.logprobs_format import FLOOR, LogprobsFormatter, prompt_entries
from services.router.api.openai_request import parse_request
from services.router.api.response_schemas import ChatLogprobs, CompletionLogprobs
from services.router.api.responses import SSEChunks, output_options
from services.router.core.errors import APIError
from services.router.core.merger import TokenMerger
from services.router.core.request_stream import RequestStream
from services.router.routing.policy import RouteDecision
from shared.bus.messages import Pipeline
from shared.engine.logprobs import TokenLogprobs
from shared.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
A, B, C = ord("a"), ord("b"), ord("c")


def parse(body: dict, chat: bool = False):
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    raw = json.dumps({**base, **body}).encode()
    return parse_request(raw, chat, model_id="m", tokenizer=TOK, max_model_len=512, max_tokens_default=8)


# ---- the request ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chat, body, counts",
    [
        (False, {}, (None, None)),
        (False, {"logprobs": 0}, (0, None)),
        (False, {"logprobs": 5, "echo": True}, (5, 5)),
        (False, {"echo": True}, (None, None)),  # the prompt's text only
        (True, {"logprobs": True}, (0, None)),
        (True, {"logprobs": True, "top_logprobs": 20}, (20, None)),
        (True, {"logprobs": False, "top_logprobs": 0}, (None, None)),
    ],
)
def test_the_requested_counts_reach_the_sampling_params(chat, body, counts):
    params = parse(body, chat).params
    assert (params.logprobs, params.prompt_logprobs) == counts


@pytest.mark.parametrize(
    "chat, body, param",
    [
        (False, {"logprobs": 21}, "logprobs"),
        (False, {"logprobs": -1}, "logprobs"),
        (False, {"logprobs": True}, "logprobs"),
        (False, {"logprobs": 2.5}, "logprobs"),
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        (True, {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        (True, {"logprobs": 3}, "logprobs"),
        (True, {"logprobs": 1}, "logprobs"),  # (1 == True, yet not a boolean)
        (True, {"echo": True}, "echo"),  # a completions field
        (False, {"top_logprobs": 3}, "top_logprobs"),  # a chat field
        (False, {"logprobs": 2, "n": 17}, "n"),  # over MAX_N
        (False, {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ],
)
def test_out_of_range_or_misplaced_fields_are_a_400_naming_them(chat, body, param):
    with pytest.raises(APIError) as e:
        parse(body, chat)
    assert e.value.status == 400 and e.value.param == param and f"'{param}'" in str(e.value)


def test_output_options():
    opts = output_options(
        parse({"logprobs": 1, "echo": True, "stream": True, "stream_options": {"include_usage": True}}), TOK
    )
    assert (opts.chat, opts.logprobs, opts.echo, opts.include_usage) == (False, True, "hi", True)
    by_ids = parse_request(
        json.dumps({"prompt": [A, B], "echo": True}).encode(),
        False,
        model_id="m",
        tokenizer=TOK,
        max_model_len=512,
        max_tokens_default=8,
    )
    assert output_options(by_ids, TOK).echo == "ab"
    chat = output_options(parse({"logprobs": True, "stream": True}, chat=True), TOK)
    assert (chat.chat, chat.logprobs, chat.echo, chat.include_usage) == (True, True, None, False)


# ---- the merger -------------------------------------------------------------------------------
def lp(x: float) -> TokenLogprobs:
    return TokenLogprobs(x, [A], [x])


def test_each_token_keeps_its_logprobs_through_reordering_and_duplicates():
    m = TokenMerger(max_tokens=8)
    assert m.add(2, [C], logprobs=[lp(-3.0)]).tokens == []  # ahead of a gap
    r = m.add(0, [A, B], logprobs=[lp(-1.0), lp(-2.0)])
    assert r.tokens == [A, B, C] and r.logprobs == [lp(-1.0), lp(-2.0), lp(-3.0)]
    r = m.add(2, [A, B], logprobs=[lp(-9.0), lp(-4.0)])  # index 2 again: the first copy stands
    assert r.tokens == [B] and r.logprobs == [lp(-4.0)]
    assert m.add(4, [A]).logprobs == [None]  # a producer that sent none


# ---- the formats ------------------------------------------------------------------------------
def test_completions_format_puts_the_chosen_token_among_the_top_and_offsets_run_on():
    fmt = LogprobsFormatter(TOK, chat=False)
    first = fmt([A, B], [TokenLogprobs(-0.5, [A, C], [-0.5, -1.0]), TokenLogprobs(-4.0, [A], [-0.1])])
    assert first == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -4.0],
        "top_logprobs": [{"a": -0.5, "c": -1.0}, {"a": -0.1, "b": -4.0}],
        "text_offset": [0, 1],
    }
    later = fmt([C], [TokenLogprobs(float("-inf"), [], [])])  # the next stream chunk
    assert later["text_offset"] == [2] and later["token_logprobs"] == [FLOOR]  # JSON has no -inf
    CompletionLogprobs.model_validate(first)


def test_echo_puts_the_prompt_first_with_no_logprob_for_its_first_token():
    entries = prompt_entries(3, [lp(-1.0), lp(-2.0)])
    assert entries == [None, lp(-1.0), lp(-2.0)]
    assert prompt_entries(3, None) == [None, None, None]  # never lost: padded
    body = LogprobsFormatter(TOK, chat=False)([A, B, C], entries)
    assert body["token_logprobs"] == [None, -1.0, -2.0] and body["top_logprobs"][0] is None
    CompletionLogprobs.model_validate(body)


def test_chat_format_has_bytes_and_exactly_the_top_asked_for():
    body = LogprobsFormatter(TOK, chat=True)([0xE2], [TokenLogprobs(-0.5, [B, C], [-0.25, -0.5])])
    (entry,) = body["content"]
    assert entry["logprob"] == -0.5 and entry["bytes"] == list(entry["token"].encode())
    assert entry["top_logprobs"] == [
        {"token": "b", "logprob": -0.25, "bytes": [B]},
        {"token": "c", "logprob": -0.5, "bytes": [C]},
    ]
    ChatLogprobs.model_validate(body)


def sse_json(chunk: bytes) -> dict:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    return json.loads(chunk[6:])


def stream_of(prompt: list[int]) -> RequestStream:
    return RequestStream("cmpl-1", prompt, RouteDecision(Pipeline.P_MD, 0.0, 0, 0.0), "md0")


def test_stream_chunks_carry_their_tokens_logprobs_the_echo_and_the_usage():
    stream = stream_of([A, B])
    stream.prompt_logprobs = [lp(-7.0)]
    opts = output_options(
        parse(
            {
                "prompt": [A, B],
                "logprobs": 1,
                "echo": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ),
        TOK,
    )
    chunks = SSEChunks(stream, opts, "m", TOK)
    echo = sse_json(chunks.echo("ab"))["choices"][0]
    assert echo["text"] == "ab" and echo["logprobs"]["token_logprobs"] == [None, -7.0]
    tokens = sse_json(chunks.tokens("c", [C], [lp(-0.5)]))["choices"][0]
    assert tokens["logprobs"]["token_logprobs"] == [-0.5] and tokens["logprobs"]["text_offset"] == [2]
    last = sse_json(chunks.tokens("", [], None, "length"))["choices"][0]
    assert last["logprobs"] is None and last["finish_reason"] == "length"
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert sse_json(chunks.usage(usage)) | {"created": 0} == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [],
        "usage": usage,
    }


def test_chat_stream_chunks_without_logprobs_asked_carry_none():
    opts = output_options(parse({"stream": True}, chat=True), TOK)
    chunk = sse_json(SSEChunks(stream_of([A]), opts, "m", TOK).tokens("a", [A], [None]))
    assert chunk["choices"][0] == {
        "index": 0,
        "finish_reason": None,
        "logprobs": None,
        "delta": {"content": "a"},
    }
