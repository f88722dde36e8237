"""`pdd chaos`'s clients against made-up routers (a stdlib HTTP server each, no system): a
refused request goes to the next router, a broken stream resumes on another one with
Last-Event-ID, and a stream that cannot resume fails with a clear error, never hangs."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.chaos import Window, _score, pipeline_of, router_of
from bench.chaos_client import PIPELINES, Routers, Stream, stream_request
from bench.chaos_report import targets_of

N = 6  # tokens of every made-up stream: 0, 1, ..., N-1


def _handler(mode: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(503 if mode == "refuse" else 200)
            self.end_headers()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            if mode == "refuse":
                self.send_response(503)
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "draining"}}')
                return
            last = self.headers.get("last-event-id")
            if mode in ("unknown", "break") and last is not None:  # a router that cannot resume it
                self.send_response(404)
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "no such request"}}')
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            start = int(last) + 1 if last is not None and mode != "fresh" else 0
            stop = 3 if mode in ("break", "break-no-id") else N
            rid = "cmpl-other" if mode == "fresh" else "cmpl-1"
            for k in range(start, stop):
                data = {"id": rid, "choices": [{"index": 0, "text": "", "token_ids": [k]}]}
                head = b"" if mode == "break-no-id" else f"id: {k}\n".encode()
                self.wfile.write(head + f"data: {json.dumps(data)}\n\n".encode())
            if stop == N:
                self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@contextmanager
def routers(*modes: str) -> Iterator[Routers]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(m)) for m in modes]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        with Routers([f"http://127.0.0.1:{s.server_address[1]}" for s in servers]) as r:
            yield r
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


BODY = {"prompt": [1, 2, 3], "max_tokens": N, "stream": True}


def test_a_broken_stream_resumes_on_the_next_router_from_the_last_event_id() -> None:
    with routers("break", "serve") as r:
        t = stream_request(r, 0, BODY, timeout=10)
    assert t.ok and t.resumed, t.error
    assert t.token_ids == list(range(N))
    assert (t.broke, t.reconnects, t.served_by, t.refused) == (1, 1, [0, 1], 0)


def test_a_refused_request_goes_to_the_next_router() -> None:
    with routers("refuse", "serve") as r:
        t = stream_request(r, 0, BODY, timeout=10)
    assert t.ok and not t.resumed and t.broke == 0
    assert t.token_ids == list(range(N))
    assert t.refused == 1 and t.served_by == [1]


@pytest.mark.parametrize(
    ("modes", "error"),
    [
        (("break-no-id", "serve"), "no SSE id to resume from"),
        (("break", "fresh"), "the reconnect started another request"),
        (("break", "unknown"), "not resumed within 2 s: 404"),  # both routers answer 404
    ],
)
def test_a_stream_that_cannot_resume_fails_clearly(modes: tuple[str, str], error: str, monkeypatch) -> None:
    monkeypatch.setattr("bench.chaos_client.RESUME_WINDOW_S", 2.0)  # the bench's 8 s, shortened
    with routers(*modes) as r:
        t = stream_request(r, 0, BODY, timeout=10)
    assert not t.ok and error in (t.error or "")
    assert t.end < 4  # failed within the resume window, not hung


def test_both_pipelines_reach_every_router() -> None:
    for k in (1, 2, 3):
        seen = {(router_of(i, k), pipeline_of(i)) for i in range(4 * k)}
        assert seen == {(r, p) for r in range(k) for p in PIPELINES}


def _stream(router: int, tokens: list[int], *, start: float, end: float, **kw) -> Stream:
    t = Stream(status=200, started=start, router=router, done=True, end=end, **kw)
    t.token_ids, t.chunks = list(tokens), [(0.1 * (i + 1), 1) for i in range(len(tokens))]
    return t


def test_targets_count_affected_resumed_and_broken_streams() -> None:
    """A router crash: of the three streams in flight on the crashed router, two resumed with
    the undisturbed tokens, one failed; the stream on the other router is not affected."""
    ref = {0: [1, 2, 3], 1: [4, 5, 6]}
    window = Window(start=10.0, end=10.0, target="router")
    broken = _stream(0, [1], start=9.0, end=3.0, broke=1)
    broken.error, broken.done = "connection broke", False
    crash = [
        (0, _stream(0, [1, 2, 3], start=9.0, end=3.0, broke=1, reconnects=1, resumed=True)),
        (1, _stream(0, [4, 5, 6], start=9.5, end=3.0, broke=1, reconnects=1, resumed=True)),
        (0, broken),
        (1, _stream(1, [4, 5, 6], start=9.0, end=3.0)),
    ]
    rows = {"kill-router": _score(crash, ref, 90.0, window, "kill-router")}
    row = rows["kill-router"]
    assert (row["affected"], row["affected_completed"], row["resumed_equal"]) == (3, 2, 2)
    assert (row["broken_connections"], row["failed_clear"], row["missing_or_repeated"]) == (3, 1, 0)
    targets = {t["what"].split(" (")[0]: t for t in targets_of(rows)}
    assert targets["router SIGKILL"]["met"] is False  # 2 of 3 < 95%
    assert targets["router SIGKILL"]["value"] == {"broken": 3, "resumed": 2}
    assert targets["router SIGTERM"]["met"] is None  # not run
    assert all("met" in t for t in targets_of(rows))
