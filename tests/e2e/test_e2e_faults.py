"""Faults against a real system (`pdd up`): an instance frozen or killed mid-stream, the
gateway between the datacenters cut, a NATS server restarted, the router killed. Every
stream either ends with exactly the tokens of an undisturbed run (greedy), moved to a live
instance by its token IDs, or with a clear error within its bound; nothing hangs; afterwards
no instance holds a request or a KV block, and the system serves the next request."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from pdd.supervisor import read_pid
from pdd.system import RunningSystem, start_system
from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine
from tests.e2e.test_e2e_pipelines import ref_tokens
from tests.e2e.test_e2e_shared_in_flight import until_md_holds
from tests.polling import wait_until
from tests.prometheus_samples import wait_until_drained

PRESET = "small"  # decodes slowly enough on a CPU that a fault lands mid-stream
MAX_TOKENS = 160


def _pid_of(system: RunningSystem, name: str, timeout_s: float = 60.0) -> int:
    """The pid of one of the system's processes (from `pdd up`'s pid files), once it runs."""
    return wait_until(lambda: read_pid(system.workdir, name), timeout_s, 0.2, f"{name} running")


def kill(system: RunningSystem, name: str) -> Callable[[], None]:
    return lambda: os.kill(_pid_of(system, name), signal.SIGKILL)


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    # Long router timeouts: a stream that survives did so by moving, not by a timeout.
    # Backends give up on a silent router after 3 s (4 s by default): the frozen-router case is shorter.
    env = {"PDD_ROUTER_TOKEN_TIMEOUT_S": "60", "PDD_ORPHAN_AFTER_S": "3"}
    sysm = start_system(tmp_path_factory.mktemp("pdd-faults"), env, model_preset=PRESET)
    yield sysm
    sysm.stop()


def body(pipeline: str, salt: int, n: int = 48, max_tokens: int = MAX_TOKENS) -> dict:
    prompt = [(i * 11 + salt * 17 + 5) % 250 for i in range(n)]
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "pdd": {"pipeline": pipeline},
    }


@dataclass
class Streamed:
    tokens: list[int] = field(default_factory=list)
    error: dict | None = None
    pipeline: str | None = None
    done: bool = False  # [DONE] seen
    seconds: float = 0.0


def stream(
    system: RunningSystem,
    payload: dict,
    at_token: int = -1,
    fault: Callable[[], None] | None = None,
    at_s: float | None = None,
) -> Streamed:
    """One streamed completion; `fault()` runs (in a thread, so the stream keeps being read)
    once `at_token` tokens arrived, or `at_s` seconds after the request was sent."""
    out, t0, fired = Streamed(), time.monotonic(), None
    if fault is not None and at_s is not None:
        fired = threading.Timer(at_s, fault)
        fired.start()
    with httpx.stream("POST", f"{system.router_url}/v1/completions", json=payload, timeout=90) as r:
        assert r.status_code == 200, r.read()
        out.pipeline = r.headers.get("x-pdd-pipeline")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out.done = True
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = chunk["error"]
                break
            out.tokens += chunk["choices"][0]["token_ids"]
            if fault is not None and fired is None and len(out.tokens) >= at_token:
                fired = threading.Thread(target=fault)
                fired.start()
    if fired is not None:
        fired.join(30)
    out.seconds = time.monotonic() - t0
    return out


def settled(system: RunningSystem, timeout_s: float = 20.0) -> dict:
    """Wait until every instance reports no request held and no KV block in use, and no
    service holds an entry in a per-request map (pdd_open_entries); the instances' view."""
    deadline = time.monotonic() + timeout_s
    seen: dict = {}

    def quiet() -> dict | None:
        try:
            seen["view"] = view = system.instances()
        except httpx.HTTPError:  # the router is restarting
            return None
        roles = {k.split("/")[0] for k in view}
        busy = [k for k, v in view.items() if v["held"] or v["used_blocks"]]
        return view if not busy and {"prefill", "relay", "main_decode"} <= roles else None

    what = lambda: f"instances holding no request and no block: {seen.get('view')}"  # noqa: E731
    view = wait_until(quiet, timeout_s, 0.5, what)
    left = wait_until_drained(system, max(deadline - time.monotonic(), 1.0))
    assert not left, f"per-request maps not empty: {left}"
    return view


def serves_again(system: RunningSystem, timeout_s: float = 30.0) -> None:
    last = {"error": ""}

    def served() -> bool:
        try:
            r = httpx.post(
                f"{system.router_url}/v1/completions",
                timeout=60,
                json={"prompt": "back again", "max_tokens": 4, "pdd": {"pipeline": "p-md"}},
            )
        except httpx.HTTPError as e:  # the router is restarting
            last["error"] = str(e)
            return False
        last["error"] = r.text
        return r.status_code == 200

    wait_until(served, timeout_s, 0.5, lambda: f"the system serving again (last: {last['error']})")


def reference(system: RunningSystem, payload: dict) -> list[int]:
    ref = stream(system, payload)
    assert ref.error is None and len(ref.tokens) == payload["max_tokens"]
    return ref.tokens


def freeze(pid: int, seconds: float) -> Callable[[], None]:
    def run() -> None:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)  # the fault itself: the process stays frozen this long
        finally:
            os.kill(pid, signal.SIGCONT)

    return run


def test_main_decode_frozen_for_5s_mid_stream_moves_the_stream_by_token_ids(system):
    payload = body("p-md", salt=1)
    want = reference(system, payload)
    got = stream(system, payload, at_token=10, fault=freeze(_pid_of(system, "main_decode"), 5.0))
    assert got.error is None and got.done
    assert got.tokens == want  # nothing missing, nothing repeated, the same tokens
    settled(system)  # the frozen MD's attempt was dropped once it woke (stale) or finished
    serves_again(system)


def test_a_moved_stream_keeps_its_penalties_and_bias(system):
    """The instance that takes the stream over processes its logits from the token history."""
    payload = body("p-md", salt=9) | {
        "repetition_penalty": 1.4,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "logit_bias": {"65": 4.0},
        "min_tokens": 20,
    }
    want = reference(system, payload)
    assert want != reference(system, body("p-md", salt=9))  # the fields matter
    got = stream(system, payload, at_token=10, fault=freeze(_pid_of(system, "main_decode"), 5.0))
    assert got.error is None and got.done
    assert got.tokens == want
    settled(system)


def test_a_5s_gateway_cut_fails_no_stream(system):
    payload = body("p-md", salt=2)
    want = reference(system, payload)

    def cut() -> None:
        for link in ("gw-ab", "gw-ba"):
            system.wan(link, cut=True, cut_mode="drop")
        time.sleep(5.0)  # the fault itself: the gateway stays cut this long
        for link in ("gw-ab", "gw-ba"):
            system.wan(link, cut=False)

    got = stream(system, payload, at_token=10, fault=cut)
    assert got.error is None and got.done and got.tokens == want
    settled(system, timeout_s=30)
    serves_again(system)


def test_a_router_frozen_past_its_heartbeat_bound_loses_nothing(system):
    """The backends drop the requests of a router that went silent (freeing their blocks);
    once it runs again it finds its stream held by nobody and moves it by token IDs."""
    # Still decoding when the backends give up (4 s after the freeze): ~6 ms a token at batch 1
    # on a fast host, so ~6 s of decoding.
    payload = body("p-md", salt=3, max_tokens=1000)
    want = reference(system, payload)
    router = _pid_of(system, "router")
    got = stream(system, payload, at_token=10, fault=freeze(router, 4.5))
    assert got.error is None and got.done and got.tokens == want
    md_log = system.log("main_decode")
    assert "router 0-" in md_log and "stopped heartbeating" in md_log
    settled(system)


def test_main_decode_killed_mid_stream(system):
    payload = body("p-md", salt=4)
    want = reference(system, payload)
    got = stream(system, payload, at_token=10, fault=kill(system, "main_decode"))
    assert got.error is None and got.done and got.tokens == want
    settled(system, timeout_s=60)  # includes MD's restart by `pdd up`
    serves_again(system)


def test_relay_killed_while_it_streams_ahead_of_main_decode(system):
    payload = body("p-rld-md", salt=5, n=320)
    want = reference(system, payload)
    with system.shaped("bulk", bandwidth_mbps=15):  # MD's copy of the prompt KV takes ~3 s
        got = stream(system, payload, at_token=5, fault=kill(system, "relay"))
    assert got.error is None and got.done and got.tokens == want
    settled(system, timeout_s=60)
    serves_again(system)


def test_prefill_killed_while_a_shared_prefix_crosses_the_wan(system):
    """The second request waits for blocks the first one's transfer carries when prefill dies:
    both move, and both still give the undisturbed tokens."""
    first = body("p-md", salt=9, n=384, max_tokens=24)
    second = {**first, "prompt": first["prompt"] + body("p-md", salt=10, n=64)["prompt"]}
    engine = LLMEngine(ModelSettings(preset=PRESET), EngineSettings(kv_memory_mb=64))
    want = [ref_tokens(engine, p["prompt"], max_tokens=24, ignore_eos=True) for p in (first, second)]
    with system.shaped("bulk", bandwidth_mbps=24), concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = [pool.submit(stream, system, first)]
        until_md_holds(system, "in_flight_blocks")  # the first's prefix is on the wire (~2 s)
        got.append(pool.submit(stream, system, second))
        until_md_holds(system, "in_flight_waiting")  # the second waits for it
        kill(system, "prefill")()
        got = [g.result() for g in got]
    for g, w in zip(got, want, strict=True):
        assert g.error is None and g.done and g.tokens == w
    settled(system, timeout_s=60)
    serves_again(system)


def test_prefill_killed_before_the_first_token(system):
    payload = body("p-md", salt=6, n=1200, max_tokens=40)
    want = reference(system, payload)
    got = stream(system, payload, fault=kill(system, "prefill"), at_s=0.3)
    assert got.error is None and got.done and got.tokens == want
    settled(system, timeout_s=60)
    serves_again(system)


@pytest.mark.parametrize("server", ["nats-a", "nats-b"])
def test_a_nats_server_restart_fails_no_stream(system, server):
    payload = body("p-md", salt=7)
    want = reference(system, payload)
    got = stream(system, payload, at_token=10, fault=kill(system, server))
    assert got.error is None and got.done and got.tokens == want
    settled(system, timeout_s=60)
    serves_again(system)


def test_a_killed_router_leaves_nothing_held_and_comes_back(system):
    payload = body("p-md", salt=8, max_tokens=600)
    with pytest.raises(httpx.HTTPError):  # the client's connection goes with the router
        stream(system, payload, at_token=10, fault=kill(system, "router"))
    settled(system, timeout_s=60)  # the backends dropped the dead router's request
    serves_again(system, timeout_s=60)
