"""Resumable streams: SSE event ids (the request, the tokens sent, the seed, a digest), and a
stream resumed from any event of an undisturbed one, fed deltas grouped differently, giving
the client every token and every character once, the same as the undisturbed stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from services.router.api.detokenizer import Detokenizer
from services.router.api.openai_request import parse_request
from services.router.api.responses import output_options, rest_of_ended, sse
from services.router.api.resume import EventId, Progress, Replay, parse_event_id
from services.router.core.request_stream import Delta, RequestStream
from services.router.routing.policy import RouteDecision
from shared.bus.messages import Pipeline
from shared.engine import SamplingParams
from shared.model.tokenizer import ByteTokenizer
from shared.telemetry.vllm_metrics import RequestMetrics

TOK = ByteTokenizer()
RID = "cmpl-0-1a2b3c4d-0123456789abcdef"
OUTPUT = list("Grüße, naïve café — done. ".encode()) * 2  # multi-byte characters split over tokens
SEED = 12345


# ---- event ids ------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["", "end", "usage"])
def test_an_event_id_reads_back_as_written(phase):
    eid = EventId(RID, 42, 2**63 - 1, "0123456789abcdef", phase)
    assert parse_event_id(str(eid)) == eid
    assert str(eid).startswith(f"{RID}:42:7fffffffffffffff:0123456789abcdef")


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        f"{RID}:1:ff",  # too few fields
        f"{RID}:x:ff:0123456789abcdef",
        f"{RID}:-1:ff:0123456789abcdef",
        f"{RID}:1:zz:0123456789abcdef",
        f"{RID}:1:ff:0123",
        f"{RID}:1:ff:0123456789abcdef:later",
        f"{RID}:1:{2**63:x}:0123456789abcdef",
        "other-1:1:ff:0123456789abcdef",  # not a request id of ours
        "cmpl-a.b:1:ff:0123456789abcdef",  # would not be one NATS subject token
        "cmpl-a*:1:ff:0123456789abcdef",
    ],
)
def test_what_is_not_an_event_id_of_ours_is_refused(value):
    with pytest.raises(ValueError):
        parse_event_id(value)


def test_the_digest_follows_the_prompt_and_the_tokens_not_how_they_were_grouped():
    a, b = Progress(RID, SEED, [1, 2, 3]), Progress(RID, SEED, [1, 2, 3])
    a.add([5, 6, 7])
    b.add([5])
    b.add([6, 7])
    assert a.event_id() == b.event_id() and a.sent == 3
    c = Progress(RID, SEED, [1, 2, 4])
    c.add([5, 6, 7])
    assert c.digest != a.digest
    d = Progress(RID, SEED, [1, 2, 3])
    d.add([5, 7, 6])
    assert d.digest != a.digest


# ---- a stream and its resumption ---------------------------------------------------------
class FakeCore:
    model_id = served_model_name = "m"

    def __init__(self, groups: list[list[int]]):
        self.groups = groups
        self.vllm = RequestMetrics("m", "resume-test")

    async def deltas(self, stream: RequestStream) -> AsyncIterator[Delta]:
        for i, g in enumerate(self.groups):
            last = i == len(self.groups) - 1
            yield Delta(g, finished=last, finish_reason="length" if last else None)


def grouped(tokens: list[int], sizes: list[int]) -> list[list[int]]:
    out, i, k = [], 0, 0
    while i < len(tokens):
        n = sizes[k % len(sizes)]
        out.append(tokens[i : i + n])
        i, k = i + n, k + 1
    return out


def parsed(chat: bool, prompt: str = "hi", **extra):
    base = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    raw = json.dumps({**base, "stream": True, "max_tokens": len(OUTPUT), **extra}).encode()
    return parse_request(raw, chat, model_id="m", tokenizer=TOK, max_model_len=4096, max_tokens_default=8)


def stream_for(p) -> RequestStream:
    params: SamplingParams = p.params
    params.seed = params.seed if params.seed is not None else SEED
    return RequestStream(
        f"cmpl-0-ffff0000-{len(p.prompt_ids)}",
        p.prompt_ids,
        RouteDecision(Pipeline.P_MD, 0.0, 0, 0.0),
        "md0",
        params=params,
    )


async def events(p, groups, resume: EventId | None = None) -> list[tuple[str | None, str]]:
    """(id, data) of each SSE event."""
    stream = stream_for(p)
    body = b"".join(
        [
            b
            async for b in sse(
                FakeCore(groups), stream, Detokenizer(TOK, p.params.stop), output_options(p, TOK), resume
            )
        ]
    )
    out = []
    for raw in body.decode().split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in raw.split("\n"))
        out.append((fields.get("id"), fields["data"]))
    return out


def content(evs) -> tuple[str, list[int], list[str]]:
    """The text, the tokens (completions) and the finish reasons the client got."""
    text, tokens, reasons = "", [], []
    for _, data in evs:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        for c in chunk["choices"]:
            text += c.get("text", "") or c.get("delta", {}).get("content", "") or ""
            tokens += c.get("token_ids", [])
            if c.get("finish_reason"):
                reasons.append(c["finish_reason"])
    return text, tokens, reasons


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stop", [None, ["done"]])
async def test_a_stream_resumed_after_any_event_gives_each_token_and_character_once(chat, stop):
    p = parsed(chat, stop=stop) if stop else parsed(chat)
    full = await events(p, grouped(OUTPUT, [3, 1, 5]))
    want = content(full)
    assert want[0] and all(eid for eid, data in full if data != "[DONE]")  # every event has an id
    assert len({eid for eid, _ in full[:-1]}) == len(full) - 1 and full[-1][0] is None  # [DONE]: none
    for cut in range(len(full) - 1):  # the client got events[: cut + 1], then its stream broke
        eid = parse_event_id(full[cut][0])
        assert eid.rid == full[0][0].split(":")[0]
        if eid.phase:
            rest = rest_of_ended(eid, len(p.prompt_ids), output_options(p, TOK), "m").body.decode()
            assert rest == "data: [DONE]\n\n"
            continue
        again = parsed(chat, stop=stop) if stop else parsed(chat)
        resumed = await events(again, grouped(OUTPUT, [2, 7]), eid)
        got = content(full[: cut + 1] + resumed)
        if stop:  # the chunk that stops carries its delta's tokens past the stop: they depend on the grouping
            assert (got[0], got[2]) == (want[0], want[2]), cut
        else:
            assert got == want, cut
        ids = [json.loads(d)["id"] for _, d in resumed if d != "[DONE]"]
        assert set(ids) == {eid.rid}  # the chunks keep the id the client knows
        assert resumed[-1][1] == "[DONE]"


async def test_a_resume_with_another_prompt_is_an_error_not_other_text():
    p = parsed(False)
    full = await events(p, grouped(OUTPUT, [4]))
    for cut in (0, 3):  # before any token, and after some
        eid = parse_event_id(full[cut][0])
        resumed = await events(parsed(False, prompt="another prompt"), grouped(OUTPUT, [4]), eid)
        error = json.loads(resumed[0][1])["error"]
        assert error["code"] == "resume_mismatch" and resumed[-1][1] == "[DONE]"
        assert len(resumed) == 2  # not one token of it


async def test_a_resume_whose_run_ends_before_the_point_is_an_error():
    p = parsed(False)
    full = await events(p, grouped(OUTPUT, [4]))
    eid = parse_event_id(full[5][0])
    short = grouped(OUTPUT[:10], [4])  # the re-run ends after 10 tokens
    resumed = await events(parsed(False), short, eid)
    assert json.loads(resumed[0][1])["error"]["code"] == "resume_mismatch"


def test_after_the_last_chunk_only_the_usage_and_the_end_are_left():
    p = parsed(False, stream_options={"include_usage": True})
    eid = EventId(RID, 7, SEED, "0123456789abcdef", "end")
    body = rest_of_ended(eid, len(p.prompt_ids), output_options(p, TOK), "m").body.decode()
    usage_event, done = body.split("\n\n")[:2]
    assert usage_event.startswith(f"id: {RID}:7:") and usage_event.split("\n")[0].endswith(":usage")
    usage = json.loads(usage_event.split("data: ", 1)[1])["usage"]
    assert usage == {"prompt_tokens": 2, "completion_tokens": 7, "total_tokens": 9} and done == "data: [DONE]"
    after_usage = EventId(RID, 7, SEED, "0123456789abcdef", "usage")
    assert rest_of_ended(after_usage, 2, output_options(p, TOK), "m").body == b"data: [DONE]\n\n"


def test_a_replay_holds_back_what_the_client_has():
    target = Progress(RID, SEED, [9])
    target.add([1, 2, 3, 4])
    progress = Progress(RID, SEED, [9])
    replay = Replay(target.event_id(), progress, Detokenizer(TOK, []))
    assert replay.take(Delta([1, 2])) is None and replay.left == 2
    rest = replay.take(Delta([3, 4, 5, 6], logprobs=[None, None, None, None]))
    assert rest is not None and rest.tokens == [5, 6] and len(rest.logprobs) == 2 and replay.left == 0


async def test_the_chat_role_chunk_goes_out_with_the_first_token_not_before():
    """A client takes the first chunk with choices for its first token: the role chunk waits
    for the first delta (here held back until the test lets it through)."""
    import asyncio

    gate = asyncio.Event()

    class HeldCore(FakeCore):
        async def deltas(self, stream):
            await gate.wait()
            async for d in super().deltas(stream):
                yield d

    p = parsed(True)
    body = sse(HeldCore([OUTPUT]), stream_for(p), Detokenizer(TOK, p.params.stop), output_options(p, TOK))
    first = asyncio.ensure_future(body.__anext__())
    await asyncio.sleep(0.05)
    assert not first.done()  # nothing is sent while no token has come
    gate.set()
    role = json.loads((await asyncio.wait_for(first, 5)).decode().split("data: ", 1)[1])
    assert role["choices"][0]["delta"] == {"role": "assistant"}
    tokens = json.loads((await asyncio.wait_for(body.__anext__(), 5)).decode().split("data: ", 1)[1])
    assert tokens["choices"][0]["delta"]["content"]
    await body.aclose()


@pytest.mark.parametrize("chat", [False, True])
async def test_the_last_tokens_come_in_the_chunk_with_the_finish_reason(chat):
    """As OpenAI's and vLLM's streams end: a benchmark takes every chunk with choices for a
    token, so no empty chunk follows the last one."""
    p = parsed(chat, stream_options={"include_usage": True})
    groups = grouped(OUTPUT, [5])
    chunks = [json.loads(data) for _, data in await events(p, groups) if data != "[DONE]"]
    with_choices = [c for c in chunks if c["choices"]]
    assert len(with_choices) == len(groups) + chat  # (chat: the role chunk first)
    reasons = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert reasons == [None] * (len(with_choices) - 1) + ["length"]
    last = with_choices[-1]["choices"][0]
    assert last["delta"]["content"] if chat else last["text"] and last["token_ids"] == groups[-1]
    text, tokens, _ = content(await events(p, groups))
    assert text == TOK.decode(OUTPUT) and (chat or tokens == OUTPUT)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(OUTPUT)
