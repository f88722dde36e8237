"""A request's n choices read back to the client (services/router/api/parallel_sse.py and
whole_response.py): chunks interleaved by index, each choice's own end, the summed usage, and
one choice failing failing the request at once, never a hang.

The core here is a stand-in that replays each child's deltas or error: one backend failing
one child of a request (children are identical requests) is a fault the e2e systems cannot
produce on demand. The real core's paths are the e2e tests' (tests/e2e/test_router_http.py)."""

from __future__ import annotations

import asyncio
import json

from services.router.api.detokenizer import Detokenizer
from services.router.api.parallel_sse import sse_parallel
from services.router.api.responses import OutputOptions
from services.router.api.whole_response import complete
from services.router.core.errors import APIError
from services.router.core.request_stream import Delta, RequestStream
from services.router.routing.policy import RouteDecision
from shared.bus.messages import Pipeline
from shared.model.tokenizer import ByteTokenizer
from shared.telemetry.vllm_metrics import FinishedRequest

TOK = ByteTokenizer()
PROMPT = [ord(c) for c in "hi"]


class Counts:  # vLLM's request metrics: how each choice ended
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def finished(self, req: FinishedRequest) -> None:
        self.reasons.append(req.reason)


class ReplayCore:
    served_model_name = "m"

    def __init__(self, outcomes: dict[str, list]) -> None:
        self.outcomes, self.released, self.vllm = outcomes, [], Counts()

    async def deltas(self, stream: RequestStream):
        for item in self.outcomes[stream.rid]:
            await asyncio.sleep(0)
            if isinstance(item, Exception):
                raise item
            yield item

    def release(self, stream: RequestStream) -> None:
        self.released.append(stream.rid)


class Client:  # the HTTP request: still there
    async def is_disconnected(self) -> bool:
        return False


def streams(n: int) -> list[RequestStream]:
    return [
        RequestStream(f"c{i}", PROMPT, RouteDecision(Pipeline.P_MD, 0.0, 0, 0.0), "md0") for i in range(n)
    ]


def text(s: str, finished: bool = False) -> Delta:
    return Delta([ord(c) for c in s], finished, "length" if finished else None)


def events(core: ReplayCore, n: int, opts: OutputOptions) -> list:
    async def run():
        return [
            c async for c in sse_parallel(core, streams(n), [Detokenizer(TOK, []) for _ in range(n)], opts)
        ]

    raw = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert raw[-1] == b"data: [DONE]\n\n"
    return [json.loads(c.decode().removeprefix("data: ")) for c in raw[:-1]]


def test_choices_interleave_by_index_and_each_ends_with_its_finish():
    core = ReplayCore({"c0": [text("ab"), text("c", True)], "c1": [text("xy"), text("z", True)]})
    got = events(core, 2, OutputOptions(chat=True, include_usage=True))
    content = ["", ""]
    ends = {}
    for e in got[:-1]:
        (choice,) = e["choices"]
        content[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            ends[choice["index"]] = e
    assert content == ["abc", "xyz"] and set(ends) == {0, 1}
    assert all(e["id"] == "c0" for e in got)  # one request: the first child's id
    last_end = max(ends.values(), key=got.index)
    assert last_end["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    assert len(last_end["pdd"]["choices"]) == 2
    assert got[-1]["choices"] == [] and got[-1]["usage"] == last_end["usage"]  # include_usage


def test_a_failing_choice_ends_the_stream_with_its_error():
    lost = APIError("main decode instance lost", 502, "server_error")
    core = ReplayCore({"c0": [text("ab")] * 50 + [text("c", True)], "c1": [text("x"), lost]})
    got = events(core, 2, OutputOptions(chat=False))
    assert got[-1]["error"]["message"] == "main decode instance lost"
    assert core.vllm.reasons == ["error", "error"]


def test_a_choice_that_ended_before_another_failed_is_counted_once():
    lost = APIError("main decode instance lost", 502, "server_error")
    core = ReplayCore({"c0": [text("ab", True)], "c1": [text("x")] * 50 + [lost]})
    got = events(core, 2, OutputOptions(chat=False))
    assert got[-1]["error"]["message"] == "main decode instance lost"
    assert sorted(core.vllm.reasons) == ["error", "length"]  # c0's end, then c1's failure


def test_a_failing_choice_fails_the_whole_answer_and_every_stream_is_freed():
    lost = APIError("main decode instance lost", 502, "server_error")
    core = ReplayCore({"c0": [text("ab"), text("c", True)], "c1": [lost], "c2": [text("q", True)]})
    children = streams(3)

    async def run():
        detoks = [Detokenizer(TOK, []) for _ in children]
        return await complete(Client(), core, children, detoks, OutputOptions(chat=True), {})

    r = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert r.status_code == 502 and b"main decode instance lost" in r.body
    assert sorted(core.released) == ["c0", "c1", "c2"]


def test_whole_answer_has_every_choice_and_summed_usage():
    core = ReplayCore({"c0": [text("ab", True)], "c1": [text("xyz", True)]})
    children = streams(2)

    async def run():
        detoks = [Detokenizer(TOK, []) for _ in children]
        return await complete(Client(), core, children, detoks, OutputOptions(chat=False), {})

    body = json.loads(asyncio.run(asyncio.wait_for(run(), timeout=10)).body)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "ab"), (1, "xyz")]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
