"""Routers that stop or die under streaming load, two routers in the system (`pdd up
--routers 2`): a killed router's client reconnects to the other one with `Last-Event-ID` and
gets the rest of its stream, each token once, the same as an undisturbed run; a router told
to stop (SIGTERM) says so in /health, answers new work with 503 and Retry-After, finishes
every stream it serves, and exits 0 (not restarted: it was told to stop)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from pdd.system import RunningSystem, start_system
from tests.e2e.test_e2e_faults import PRESET, _pid_of
from tests.polling import wait_until

MAX_TOKENS = 80


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    env = {"PDD_ROUTER_TOKEN_TIMEOUT_S": "60"}
    sysm = start_system(tmp_path_factory.mktemp("pdd-routers"), env, model_preset=PRESET, routers=2)
    yield sysm
    sysm.stop()


def body(salt: int, **extra) -> dict:
    prompt = [(i * 13 + salt * 29 + 7) % 250 for i in range(40)]
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, **extra}


@dataclass
class Streamed:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    last_id: str | None = None
    done: bool = False
    error: object = None  # an error chunk, or the exception that broke the stream


def stream(url: str, payload: dict, headers: dict | None = None, on_tokens=None) -> Streamed:
    """One streamed completion; `on_tokens(n)` after each chunk, n: the tokens so far."""
    out, headers = Streamed(), {"Accept": "text/event-stream", **(headers or {})}  # ids: resumable
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=payload, headers=headers, timeout=90) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("id: "):
                    out.last_id = line[4:]
                elif line == "data: [DONE]":
                    out.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.error = chunk["error"]
                        continue
                    out.tokens += chunk["choices"][0]["token_ids"]
                    out.text += chunk["choices"][0]["text"]
                    if on_tokens:
                        on_tokens(len(out.tokens))
    except httpx.HTTPError as e:  # the connection broke
        out.error = e
    return out


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_stream_cut_by_a_router_kill_resumes_on_the_other_router(system):
    """Sampled (temperature 1, no seed given): the seed the router chose travels in the event
    id, so the re-run on the other router draws the same tokens."""
    first, other = system.router_urls[1], system.router_urls[0]
    payload = body(1, temperature=1.0)
    fired = threading.Event()

    def kill_at(n: int) -> None:
        if n >= 20 and not fired.is_set():
            fired.set()
            os.kill(_pid_of(system, "router-1"), signal.SIGKILL)

    t0 = time.monotonic()
    cut = stream(first, payload, on_tokens=kill_at)
    assert fired.is_set() and isinstance(cut.error, httpx.HTTPError) and not cut.done
    assert cut.last_id and 20 <= len(cut.tokens) < MAX_TOKENS
    rest = stream(other, payload, headers={"Last-Event-ID": cut.last_id})
    resumed_s = time.monotonic() - t0
    assert rest.error is None and rest.done, rest.error
    seed = int(cut.last_id.split(":")[2], 16)
    want = stream(other, {**payload, "seed": seed})  # the undisturbed run of that request
    assert want.error is None and want.done and len(want.tokens) == MAX_TOKENS
    assert cut.tokens + rest.tokens == want.tokens  # each token once, the same tokens
    assert cut.text + rest.text == want.text
    assert resumed_s < 60
    # The killed router's request was dropped at once (the resume aborts it), not held until
    # the backends noticed that router's silence.
    for name in ("prefill", "relay", "main_decode"):
        assert "stopped heartbeating" not in system.log(name), name
    wait_until(
        lambda: not any(v["held"] for v in httpx.get(f"{other}/v1/instances", timeout=5).json().values()), 20
    )
    bad = httpx.post(f"{other}/v1/completions", json=payload, headers={"Last-Event-ID": "x:1"}, timeout=30)
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]["message"]


def test_a_router_told_to_stop_finishes_every_stream_and_exits_zero(system):
    url, other = system.router_urls[1], system.router_urls[0]
    wait_until(lambda: healthy(url), 60)  # router-1, restarted after the kill above
    long = 3 * MAX_TOKENS // 2  # still streaming while the test looks at the drain
    payloads = [body(10 + i, temperature=0, max_tokens=long) for i in range(3)]
    started = threading.Barrier(len(payloads) + 1, timeout=60)

    def streamed(p: dict) -> Streamed:
        flag = []

        def on(n: int) -> None:
            if n >= 10 and not flag:
                flag.append(1)
                started.wait()

        return stream(url, p, on_tokens=on)

    pid = _pid_of(system, "router-1")
    with concurrent.futures.ThreadPoolExecutor(2 * len(payloads)) as pool:
        want = [pool.submit(stream, other, p) for p in payloads]  # undisturbed, on the other router
        got = [pool.submit(streamed, p) for p in payloads]
        started.wait()  # every stream on router-1 is under way
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 10)
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(f"{url}/v1/completions", json={**payloads[0], "stream": False}, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        got = [g.result(timeout=90) for g in got]
        want = [w.result(timeout=90) for w in want]
    assert all(w.done and w.error is None and len(w.tokens) == long for w in want)
    for g, w in zip(got, want, strict=True):
        assert g.error is None and g.done, g.error  # not one stream broken
        assert g.tokens == w.tokens and g.text == w.text
    in_flight = re.search(r"router draining \(SIGTERM\): (\d+) requests in flight", system.log("router-1"))
    assert in_flight and int(in_flight[1]) > 0  # the drain had streams to finish
    wait_until(lambda: system.pid("router-1") is None, 30)  # it exited, with 0: not restarted
    # The supervisor drops the pid file, reaps the child, then logs it: wait for the line.
    wait_until(
        lambda: "router-1 stopped cleanly; not restarted" in (system.workdir / "pdd-up.log").read_text(), 10
    )
    assert time.monotonic() - t0 < 30
    assert healthy(other)
