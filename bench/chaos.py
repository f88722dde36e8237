"""`pdd chaos`: faults injected into a `pdd up` system (started here) under a steady streaming load.

One system (the `small` preset; `--prefill/--relay/--md/--routers/--nats-cluster` as `pdd up`'s,
one of each by default), one phase per fault. Each phase runs `--requests` streamed, greedy
completions, `--concurrency` at a time, alternating the two pipelines (p-md and p-rld-md,
forced), over a fixed pool of prompts, the requests spread round-robin over the routers;
`--fault-at` seconds into the phase the fault is injected. A first phase with no fault records
every prompt's undisturbed output, the reference each later stream is compared with, token by
token.

Faults hit one instance of their role, the others survive and take its work: of prefill,
relay and main decode the one holding the most requests at that moment (waiting up to 3 s for
one to hold any; a process name such as `prefill` or `main_decode-1`), of routers and NATS servers the first (`router`, `nats-a` or
`nats-a-0`). SIGKILL of prefill, relay and main decode (`pdd up` restarts them); SIGSTOP of
main decode for 5 s; a restart (SIGKILL) of each DC's NATS server; a 5 s cut of the NATS gateway (both directions); a 2 s cut of the bulk KV
link; a rolling router restart (`restart-router`: `pdd restart`, SIGTERM, the router drains, then
`pdd up` starts it again) and a router crash
(`kill-router`: SIGKILL).

The clients act as a load balancer's would: a router that refuses a request (503, connection
refused) or whose /health is not 200 is avoided and the request sent to the next one; a stream
whose connection breaks is reconnected to another router, same path and body, with
`Last-Event-ID` set to the last SSE `id:` seen, and continues from there (a stream that carried
no `id:` cannot resume and fails with that error).

Per fault and pipeline: requests completed, migrated (moved by token IDs), resumed (completed
after a reconnect), failed with a clear error, hung (no end within --hang-s); streams whose
connection broke, streams with tokens duplicated or missing, completed outputs unlike the
undisturbed run, KV blocks and requests still held once the system settled, time until a fresh
request succeeds again, p99 longest gap between two chunks of a migrated stream, and the share
of affected requests (in flight during the fault; for a router fault, those sent to that router)
that completed.

    pdd chaos [--requests 32] [--concurrency 16] [--max-tokens 96] [--faults kill-md,...]
              [--prefill 2 --relay 2 --md 2 --routers 2]

Writes bench/out/chaos.json and bench/out/chaos.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.client import Timed, pct, random_tokens
from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.launch import DC_A, DC_B, MAX_COUNT, nats_node_name, process_name
from pdd.supervisor import read_pid, request_restart
from pdd.system import RunningSystem, start_system

PIPELINES = ("p-md", "p-rld-md")
ROLES = {"prefill": "prefill", "relay": "relay", "main_decode": "md"}  # role in /v1/instances -> count flag
RESUME_WINDOW_S = 8.0  # a broken stream is reconnected for this long (the backends keep it ~4 s)
REFUSED_RETRY_S = 15.0  # a request refused by every router is retried for this long
AVOID_S = 1.0  # a router that refused or broke a stream is tried last for this long


# ---- faults ---------------------------------------------------------------------------
def _signal(system: RunningSystem, name: str, sig: signal.Signals) -> None:
    pid = read_pid(system.workdir, name)
    if pid is None:
        raise RuntimeError(f"{name} is not running (no pid file)")
    os.kill(pid, sig)


@dataclass(frozen=True)
class Fault:
    """`pick` names what the fault hits (it may wait for that to be busy); `act` injects it and
    returns once it is over."""

    pick: Callable[[RunningSystem], str]
    act: Callable[[RunningSystem, str], None]


def _first(role: str) -> Callable[[RunningSystem], str]:
    """The process name of the first instance of a role."""
    return lambda system: process_name(role, 0)


def _busiest(role: str, wait_s: float = 3.0) -> Callable[[RunningSystem], str]:
    """The process name of the instance of a role holding the most requests (waiting up to
    wait_s for one to hold any; the first on a tie, or when no router answers): a fault on an
    idle instance would test nothing."""

    def held_now(system: RunningSystem) -> dict[int, int]:
        for url in system.router_urls or [system.router_url]:
            try:
                view = httpx.get(f"{url}/v1/instances", timeout=2).json()
                return {int(k.split("/")[1]): v["held"] for k, v in view.items() if k.split("/")[0] == role}
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                continue
        return {}

    def pick(system: RunningSystem) -> str:
        deadline, held = time.monotonic() + wait_s, {}
        while time.monotonic() < deadline:
            held = held_now(system)
            if any(held.values()):
                break
            time.sleep(0.05)
        best = max(sorted(held), key=lambda i: held[i], default=0)
        return process_name(role, best if best < getattr(system.opts, ROLES[role]) else 0)

    return pick


def _first_nats(dc: str) -> Callable[[RunningSystem], str]:
    return lambda system: nats_node_name(dc, 0, system.opts.nats_cluster)


def _kill(target: Callable[[RunningSystem], str], sig: signal.Signals = signal.SIGKILL) -> Fault:
    return Fault(target, lambda system, name: _signal(system, name, sig))


def _pause(seconds: float) -> Callable[[RunningSystem, str], None]:
    def act(system: RunningSystem, name: str) -> None:
        _signal(system, name, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            _signal(system, name, signal.SIGCONT)

    return act


def _cut(links: tuple[str, ...], seconds: float) -> Fault:
    def act(system: RunningSystem, names: str) -> None:
        for link in names.split(","):
            system.wan(link, cut=True, cut_mode="drop")
        try:
            time.sleep(seconds)
        finally:
            for link in names.split(","):
                system.wan(link, cut=False)

    return Fault(lambda system: ",".join(n for link in links for n in _link_names(system, link)), act)


def _link_names(system: RunningSystem, link: str) -> list[str]:
    """gw-ab is gw-ab-0, gw-ab-1, ... with a NATS cluster per DC (every node's link is cut)."""
    n = system.opts.nats_cluster
    return [link] if link == "bulk" or n == 1 else [f"{link}-{i}" for i in range(n)]


FAULTS: dict[str, Fault] = {
    "kill-prefill": _kill(_busiest("prefill")),
    "kill-relay": _kill(_busiest("relay")),
    "kill-md": _kill(_busiest("main_decode")),
    "stop-md-5s": Fault(_busiest("main_decode"), _pause(5.0)),
    "restart-nats-a": _kill(_first_nats(DC_A)),
    "restart-nats-b": _kill(_first_nats(DC_B)),
    "cut-gateway-5s": _cut(("gw-ab", "gw-ba"), 5.0),
    "cut-bulk-2s": _cut(("bulk",), 2.0),
    "kill-router": _kill(_first("router")),
    "restart-router": Fault(_first("router"), lambda system, name: request_restart(system.workdir, name)),
}
NO_FAILURE_EXPECTED = ("restart-nats-a", "restart-nats-b", "cut-gateway-5s", "cut-bulk-2s", "stop-md-5s")
ROUTER_FAULTS = ("kill-router", "restart-router")
FAULTED_ROUTER = 0  # the router faults hit the first router


# ---- the clients: routers as a load balancer sees them ----------------------------------
class Routers:
    """The routers' URLs, in round-robin order from each request's own; one that refused, broke
    a stream or whose /health is not 200 comes last for AVOID_S (a watcher polls /health)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self._avoid: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Routers:
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._watcher.join()

    def avoid(self, i: int, seconds: float = AVOID_S) -> None:
        with self._lock:
            self._avoid[i] = time.monotonic() + seconds

    def order(self, first: int) -> list[int]:
        """Every router from `first` on, the avoided ones last."""
        now, k = time.monotonic(), len(self.urls)
        ring = [(first + j) % k for j in range(k)]
        with self._lock:
            return sorted(ring, key=lambda i: self._avoid.get(i, 0.0) > now)

    def _watch(self) -> None:
        with httpx.Client(timeout=1.0) as client:
            while not self._stop.wait(0.25):
                for i, url in enumerate(self.urls):
                    try:
                        healthy = client.get(f"{url}/health").status_code == 200
                    except httpx.HTTPError:
                        healthy = False
                    if not healthy:
                        self.avoid(i, 0.5)


@dataclass
class Stream(Timed):
    """One request across every connection it took (chunk times from its first send)."""

    started: float = 0.0  # monotonic time of the first send
    router: int = 0  # the router it was sent to first
    served_by: list[int] = field(default_factory=list)  # routers whose stream it read
    rid: str | None = None  # the request id its chunks carry
    last_event_id: str | None = None
    done: bool = False  # saw data: [DONE]
    refused: int = 0  # refusals (503, connection refused; of a reconnect: any non-200)
    broke: int = 0  # connections that broke mid-stream
    reconnects: int = 0  # reconnections with Last-Event-ID
    resumed: bool = False  # completed after a reconnect

    @property
    def ok(self) -> bool:
        return super().ok and self.done


class _Refused(Exception):
    """The router did not take the request: try another."""


class _Broke(Exception):
    """A started stream's connection broke (or ended without [DONE])."""


def _read(client: httpx.Client, body: dict, headers: dict, out: Stream, t0: float, timeout: float) -> None:
    """One connection: appends its chunks to `out`; returns at [DONE] or a clear error."""
    answered = False
    try:
        with client.stream("POST", "/v1/completions", json=body, headers=headers, timeout=timeout) as r:
            answered = True
            # refused: 503; a reconnect not taken (yet) by this router: any other status too
            if r.status_code == 503 or (r.status_code != 200 and "Last-Event-ID" in headers):
                raise _Refused(f"{r.status_code}: {r.read().decode(errors='replace')[:200]}")
            out.status = r.status_code
            out.pipeline_header = out.pipeline_header or r.headers.get("x-pdd-pipeline")
            if r.status_code != 200:
                out.error = r.read().decode(errors="replace")[:500]
                return
            event_id, data = None, None
            for line in r.iter_lines():
                if line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    data = line[5:].strip()
                elif line == "" and (data is not None or event_id is not None):
                    if _event(data, out, t0):  # dispatched: its id is the last one seen
                        return
                    if event_id is not None:
                        out.last_event_id = event_id
                    event_id, data = None, None
            if data is not None and _event(data, out, t0):
                return
            raise _Broke("the stream ended without [DONE]")
    except httpx.HTTPError as e:  # before the response: nothing was seen, send it elsewhere
        raise (_Broke if answered else _Refused)(f"{type(e).__name__}: {e}") from None


def _event(data: str | None, out: Stream, t0: float) -> bool:
    """One SSE event's data; True once the stream is over ([DONE], or an error that a reconnect
    would not fix)."""
    if data is None:
        return False
    if data == "[DONE]":
        out.done = True
        return True
    d = json.loads(data)
    if "error" in d:
        out.error = str(d["error"].get("message"))
        return False
    if out.rid is None:
        out.rid = d.get("id")
    elif d.get("id") not in (None, out.rid):
        out.error = f"the reconnect started another request ({d.get('id')}, not {out.rid})"
        return True
    ids = d["choices"][0].get("token_ids") or [] if d.get("choices") else []
    if ids:
        out.chunks.append((time.monotonic() - t0, len(ids)))
        out.token_ids += ids
    if "pdd" in d:
        out.pdd = d["pdd"]
    return False


def stream_request(routers: Routers, first: int, body: dict, timeout: float) -> Stream:
    """A streamed completion sent to router `first`; refused: the next router; broken: resumed
    on another one with Last-Event-ID. Never longer than `timeout` in all."""
    t0 = time.monotonic()
    # An event stream asked for as such carries SSE ids, to resume from.
    out, headers = Stream(started=t0, router=first), {"Accept": "text/event-stream"}
    deadline, broke_at, refused_since, last = t0 + timeout, None, None, None
    while time.monotonic() < deadline:
        for i in routers.order(first if last is None else (last + 1) % len(routers.urls)):
            if time.monotonic() >= deadline:
                break
            try:
                with httpx.Client(base_url=routers.urls[i]) as client:
                    _read(client, body, headers, out, t0, max(1.0, deadline - time.monotonic()))
                if out.done and out.reconnects and out.error is None:
                    out.resumed = True
                out.served_by.append(i)
                out.end = time.monotonic() - t0
                return out
            except _Refused as e:
                out.refused += 1
                routers.avoid(i)
                refused_since = refused_since or time.monotonic()
                if broke_at is None and time.monotonic() - refused_since > REFUSED_RETRY_S:
                    return _failed(out, t0, f"refused by every router for {REFUSED_RETRY_S:.0f} s: {e}")
                if broke_at is not None and time.monotonic() - broke_at > RESUME_WINDOW_S:
                    return _failed(out, t0, f"not resumed within {RESUME_WINDOW_S:.0f} s: {e}")
            except _Broke as e:
                out.served_by.append(i)
                out.broke += 1
                routers.avoid(i)
                if out.error is not None:  # an error event came before the break
                    return _failed(out, t0, out.error)
                if out.last_event_id is None:
                    return _failed(out, t0, f"connection broke, no SSE id to resume from ({e})")
                broke_at = broke_at or time.monotonic()
                if time.monotonic() - broke_at > RESUME_WINDOW_S:
                    return _failed(out, t0, f"not resumed within {RESUME_WINDOW_S:.0f} s: {e}")
                headers = {"Accept": "text/event-stream", "Last-Event-ID": out.last_event_id}
                out.reconnects += 1
            last = i
        time.sleep(0.2)
    return _failed(out, t0, out.error or "no router finished it in time")


def _failed(out: Stream, t0: float, error: str) -> Stream:
    out.error = error
    out.end = time.monotonic() - t0
    return out


def _body(prompt: list[int], max_tokens: int, pipeline: str) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "pdd": {"pipeline": pipeline},
    }


# ---- load -----------------------------------------------------------------------------
@dataclass
class Window:
    """When the fault was injected and when its injection returned (monotonic)."""

    start: float = 0.0
    end: float = 0.0
    target: str | None = None  # the process (or links) it hit


def _run_load(
    system: RunningSystem,
    args: argparse.Namespace,
    prompts: list[list[int]],
    n: int,
    name: str,
    fault: Fault | None,
) -> tuple[list[tuple[int, Stream]], float | None, Window | None]:
    """n streams (prompt index, result), request i sent first to router_of(i); the fault
    runs `fault_at` s in, while a probe measures how long until a fresh request succeeds again
    (None without a fault)."""
    recovery: list[float | None] = []
    window = Window() if fault else None

    def inject() -> None:
        time.sleep(args.fault_at)
        window.target = fault.pick(system)
        window.start = time.monotonic()
        probe = threading.Thread(target=lambda: recovery.append(_recovery_s(system, window.start)))
        probe.start()
        try:
            fault.act(system, window.target)
        finally:
            window.end = time.monotonic()
        probe.join()

    def one(i: int) -> tuple[int, Stream]:
        k = i % len(prompts)
        body = _body(prompts[k], args.max_tokens, pipeline_of(k))
        t = stream_request(routers, router_of(i, len(routers.urls)), body, args.hang_s)
        advance()
        return k, t

    injector = threading.Thread(target=inject) if fault else None
    with Routers(system.router_urls or [system.router_url]) as routers:
        if injector:
            injector.start()
        with progress(name, total=n) as advance, ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, range(n)))
        if injector:
            injector.join()
    return results, recovery[0] if recovery else None, window


def _recovery_s(system: RunningSystem, since: float, timeout_s: float = 120.0) -> float | None:
    """Seconds from `since` (the fault) until a fresh short request succeeds on some router
    (None: not within timeout_s). The first probe waits a moment: the fault must have landed."""
    time.sleep(0.5)
    urls, k = system.router_urls or [system.router_url], 0
    while time.monotonic() - since < timeout_s:
        try:
            r = httpx.post(
                f"{urls[k % len(urls)]}/v1/completions",
                timeout=30,
                json={"prompt": "probe", "max_tokens": 2, "temperature": 0},
            )
            if r.status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        k += 1
        time.sleep(0.25)
    return None


def _settle(system: RunningSystem, timeout_s: float = 90.0) -> dict[str, int]:
    """Wait until every router answers /health 200 and every instance asked for is back and
    holds no request and no KV block; what is left after timeout_s (routers down, instances
    missing, requests held, blocks used)."""
    urls = system.router_urls or [system.router_url]
    wanted = {role: getattr(system.opts, flag) for role, flag in ROLES.items()}
    deadline, left = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        up, view = 0, None
        for url in urls:
            try:
                up += httpx.get(f"{url}/health", timeout=2).status_code == 200
                if view is None:
                    view = httpx.get(f"{url}/v1/instances", timeout=10).json()
            except httpx.HTTPError:
                pass
        view = view or {}
        roles = [k.split("/")[0] for k in view]
        left = {
            "held": sum(v["held"] for v in view.values()),
            "blocks": sum(v["used_blocks"] for v in view.values()),
            "routers_down": len(urls) - up,
            "instances_missing": sum(max(0, n - roles.count(r)) for r, n in wanted.items()),
        }
        if not any(left.values()):
            break
        time.sleep(0.5)
    return left


# ---- scoring --------------------------------------------------------------------------
def pipeline_of(prompt: int) -> str:
    """Each prompt always takes the same (forced) pipeline; the pool alternates them."""
    return PIPELINES[prompt % 2]


def router_of(request: int, routers: int) -> int:
    """Round-robin by pairs of requests: the two pipelines alternate, so each reaches every router."""
    return request // len(PIPELINES) % routers


def _affected(t: Stream, window: Window | None, fault: str) -> bool:
    """In flight while the fault was injected (up to 1 s after); for a router fault, sent to
    the faulted router."""
    if window is None:
        return False
    if fault in ROUTER_FAULTS and t.router != FAULTED_ROUTER:
        return False
    return t.started <= window.end + 1.0 and t.started + t.end >= window.start


def _outcomes(results: list[tuple[int, Stream]], hang_s: float, affected: set[int]) -> dict[str, int]:
    completed = [t for _, t in results if t.ok and t.end < hang_s]
    hit = [t for _, t in results if id(t) in affected]
    return {
        "requests": len(results),
        "completed": len(completed),
        "migrated": sum(bool((t.pdd or {}).get("migrations")) for t in completed),
        "resumed": sum(t.resumed for t in completed),
        "failed_clear": sum(not t.ok and t.end < hang_s for _, t in results),
        "hung": sum(t.end >= hang_s for _, t in results),
        "broken_connections": sum(t.broke > 0 for _, t in results),
        # sent elsewhere than its first router: refused there, or that router was unhealthy
        "rerouted": sum(t.refused > 0 or t.served_by[:1] not in ([], [t.router]) for _, t in results),
        "affected": len(hit),
        "affected_completed": sum(t.ok and t.end < hang_s for t in hit),
    }


def _score(
    results: list[tuple[int, Stream]],
    reference: dict[int, list[int]],
    hang_s: float,
    window: Window | None = None,
    fault: str = "none",
) -> dict:
    completed = [t for _, t in results if t.ok and t.end < hang_s]
    migrated = [t for t in completed if (t.pdd or {}).get("migrations")]
    resumed = [t for t in completed if t.resumed]
    done = {id(t) for t in completed}
    affected = {id(t) for _, t in results if _affected(t, window, fault)}
    row = _outcomes(results, hang_s, affected)
    return {
        **row,
        "affected_completed_share": row["affected_completed"] / row["affected"] if row["affected"] else None,
        "by_pipeline": {
            p: _outcomes([(k, t) for k, t in results if pipeline_of(k) == p], hang_s, affected)
            for p in PIPELINES
        },
        # Tokens missing or repeated: the stream is not a prefix of its reference.
        "missing_or_repeated": sum(t.token_ids != reference[k][: len(t.token_ids)] for k, t in results),
        "mismatched": sum(id(t) in done and t.token_ids != reference[k] for k, t in results),
        "resumed_equal": sum(t.token_ids == reference[k] for k, t in results if id(t) in done and t.resumed),
        "errors": sorted({(t.error or "")[:160] for _, t in results if not t.ok})[:5],
        # (A resumed stream's longest gap is its client's reconnect: counted as resumed, not moved.)
        "migrated_max_gap_p99_s": pct([t.max_gap for t in migrated if not t.resumed], 99),
        "resumed_max_gap_p99_s": pct([t.max_gap for t in resumed], 99),
        "max_gap_p99_s": pct([t.max_gap for t in completed], 99),
        "moved_streams": [_moved(t, window) for t in migrated if not t.resumed],  # (where a long gap sits)
    }


def _moved(t: Stream, window: Window | None) -> dict:
    """A moved stream's longest gap, and when it opened (seconds after the fault began)."""
    gaps = t.gaps
    longest = max(gaps, default=0.0)
    at = t.chunks[gaps.index(longest)][0] if gaps else 0.0
    since = t.started + at - window.start if window else None
    unix = time.time() - time.monotonic() + t.started + at  # (to read beside the traces' times)
    return {
        "rid": t.rid,
        "max_gap_s": round(longest, 3),
        "opened_after_fault_s": since,
        "opened_unix_s": unix,
    }


def _phase(
    system: RunningSystem,
    args: argparse.Namespace,
    prompts: list[list[int]],
    name: str,
    reference: dict[int, list[int]],
) -> dict:
    print(f"[{name}] {args.requests} streams, {args.concurrency} at a time ...", flush=True)
    results, recovery, window = _run_load(system, args, prompts, args.requests, f"[{name}]", FAULTS[name])
    row = _score(results, reference, args.hang_s, window, name)
    row["recovery_s"] = recovery
    row["hit"] = window.target
    with progress(f"[{name}] settling"):
        row["left_after_settling"] = _settle(system)
    print(
        f"[{name}] hit {row['hit']}: completed {row['completed']} (migrated {row['migrated']}, resumed {row['resumed']}), "
        f"failed {row['failed_clear']}, hung {row['hung']}, broke {row['broken_connections']}, "
        f"rerouted {row['rerouted']}, affected {row['affected_completed']}/{row['affected']} ok, "
        f"missing/repeated {row['missing_or_repeated']}, mismatched {row['mismatched']}, "
        f"recovery {row['recovery_s']}, left {row['left_after_settling']}",
        flush=True,
    )
    return row


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [random_tokens(rng, rng.randrange(64, 400)) for _ in range(args.prompts)]
    workdir = Path(tempfile.mkdtemp(prefix="pdd-chaos-"))
    t0 = time.monotonic()
    counts = {k: getattr(args, k) for k in ("prefill", "relay", "md", "routers", "nats_cluster")}
    with progress("starting pdd up"):
        system = start_system(
            workdir,
            {"PDD_ROUTER_TOKEN_TIMEOUT_S": "60"},
            model_preset=args.preset,
            delay_ms=args.delay_ms,
            bandwidth_mbps=args.bandwidth_mbps,
            timeout_s=300,
            **counts,
        )
    try:
        base, _, _ = _run_load(system, args, prompts, 2 * len(prompts), "[none] reference", None)
        reference = {k: t.token_ids for k, t in base if t.ok}
        if len(reference) < len(prompts):
            raise RuntimeError(f"the undisturbed run failed: {[t.error for _, t in base if not t.ok][:3]}")
        rows = {"none": _score(base, reference, args.hang_s)}
        for name in args.faults.split(","):
            rows[name] = _phase(system, args, prompts, name, reference)
    finally:
        system.stop()
    return {
        "config": vars(args),
        "instances": counts,
        "faults": rows,
        "targets": _targets(rows),
        "wall_s": time.monotonic() - t0,
    }


def _targets(rows: dict[str, dict]) -> list[dict]:
    total = lambda key: sum(r.get(key, 0) for r in rows.values())  # noqa: E731
    settled = [r.get("left_after_settling") or {} for r in rows.values()]
    held = sum(s.get("held", 0) + s.get("blocks", 0) for s in settled)
    missing = sum(s.get("routers_down", 0) + s.get("instances_missing", 0) for s in settled)
    quiet = sum(rows[f]["failed_clear"] + rows[f]["hung"] for f in NO_FAILURE_EXPECTED if f in rows)
    gaps = [r["migrated_max_gap_p99_s"] for r in rows.values() if r.get("migrated")]
    gaps = [g for g in gaps if not math.isnan(g)]  # (NaN: each moved stream of that fault was resumed)
    shares = {f: r["affected_completed_share"] for f, r in rows.items() if r.get("affected")}
    worst = min(shares, key=shares.get) if shares else None
    term, crash = rows.get("restart-router"), rows.get("kill-router")
    broke = crash["broken_connections"] if crash else 0
    resumed = crash["resumed_equal"] / broke if broke else None
    return [
        {"what": "hung requests (0)", "value": total("hung"), "met": total("hung") == 0},
        {
            "what": "streams with tokens missing or repeated (0)",
            "value": total("missing_or_repeated"),
            "met": total("missing_or_repeated") == 0,
        },
        {
            "what": "completed outputs unlike the undisturbed run (0)",
            "value": total("mismatched"),
            "met": total("mismatched") == 0,
        },
        {"what": "requests or KV blocks held after settling (0)", "value": held, "met": held == 0},
        {
            "what": "routers down or instances missing after settling (0)",
            "value": missing,
            "met": missing == 0,
        },
        {
            "what": "affected requests completed, a moved or resumed one included, worst fault (>= 95%)",
            "value": {"fault": worst, "share": shares[worst]} if worst else None,
            "met": (shares[worst] >= 0.95) if worst else None,
        },
        {
            "what": "p99 longest gap of a migrated stream, worst fault (<= 2 s)",
            "value": max(gaps) if gaps else None,
            "met": (max(gaps) <= 2.0) if gaps else None,
        },
        {
            "what": "router SIGTERM (restart-router): broken streams (0)",
            "value": term["broken_connections"] if term else None,
            "met": (term["broken_connections"] == 0) if term else None,
        },
        {
            "what": "router SIGKILL (kill-router): broken streams resumed, tokens equal (>= 95%)",
            "value": {"broken": broke, "resumed": crash["resumed_equal"]} if crash else None,
            "met": (resumed is not None and resumed >= 0.95) if crash and broke else None,
        },
        {
            "what": "failed requests under NATS restart / gateway or bulk cut / MD pause (0)",
            "value": quiet,
            "met": quiet == 0,
        },
    ]


def _cell(c: dict) -> str:
    return f"{c['completed']:>3} ok {c['migrated']:>2}mv {c['resumed']:>2}rs {c['failed_clear']:>2}F {c['hung']}H"


def _print_matrix(result: dict) -> None:
    """fault x pipeline -> completed (moved / resumed) / failed / hung."""
    n = result.get("instances") or {}
    print(
        f"\nfailure matrix at prefill {n.get('prefill', 1)}, relay {n.get('relay', 1)}, md {n.get('md', 1)}, "
        f"routers {n.get('routers', 1)} (mv: migrated, rs: resumed, F: failed, H: hung)"
    )
    print(f"{'fault':16}" + "".join(f" {p:>24}" for p in PIPELINES))
    for name, r in result["faults"].items():
        cells = [r["by_pipeline"][p] for p in PIPELINES]
        print(f"{name:16}" + "".join(f" {_cell(c):>24}" for c in cells))


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def _print(result: dict) -> None:
    print(
        f"\n{'fault':16} {'done':>4} {'moved':>5} {'resum':>5} {'fail':>4} {'hung':>4} {'broke':>5} "
        f"{'m/r':>3} {'diff':>4} {'left':>4} {'affected ok':>11} {'gap p99':>7} {'back s':>6}"
    )
    for name, r in result["faults"].items():
        left = sum((r.get("left_after_settling") or {}).values())
        share = r.get("affected_completed_share")
        aff = f"{r['affected_completed']}/{r['affected']}" if share is not None else "-"
        print(
            f"{name:16} {r['completed']:4} {r['migrated']:5} {r['resumed']:5} {r['failed_clear']:4} "
            f"{r['hung']:4} {r['broken_connections']:5} {r['missing_or_repeated']:3} {r['mismatched']:4} "
            f"{left:4} {aff:>11} {_fmt(r['migrated_max_gap_p99_s']):>7} {_fmt(r.get('recovery_s')):>6}"
        )
    _print_matrix(result)
    print()
    for name, r in result["faults"].items():
        for e in r["errors"]:
            print(f"  [{name}] error: {e}")


def _figure(result: dict):
    plt = pyplot()
    names = list(result["faults"])
    rows = [result["faults"][n] for n in names]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    done = [r["completed"] - r["migrated"] - r["resumed"] for r in rows]
    moved = [r["migrated"] for r in rows]
    resumed = [r["resumed"] for r in rows]
    failed = [r["failed_clear"] for r in rows]
    ax.barh(names, done, label="completed in place")
    ax.barh(names, moved, left=done, label="after a move")
    left = [a + b for a, b in zip(done, moved, strict=True)]
    ax.barh(names, resumed, left=left, label="after a reconnect")
    left = [a + b for a, b in zip(left, resumed, strict=True)]
    ax.barh(names, failed, left=left, label="failed: error, or the connection broke")
    ax.set_xlabel("requests")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax.set_title("outcome per fault")
    bx.barh(names, [r.get("recovery_s") or 0 for r in rows])
    bx.set_xlabel("seconds from the fault until a new request succeeds")
    bx.set_title("time to recover")
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdd chaos",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list from {', '.join(FAULTS)}")
    p.add_argument("--requests", type=int, default=32, help="streams per fault phase")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts (each has a reference output)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--fault-at", type=float, default=2.0, help="seconds into a phase the fault is injected")
    p.add_argument("--hang-s", type=float, default=90.0, help="a stream still open after this has hung")
    p.add_argument("--preset", default="small")
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--bandwidth-mbps", type=float, default=200.0)
    for flag, what in (
        ("prefill", "prefill instances"),
        ("relay", "relay decoder instances"),
        ("md", "main decode instances"),
        ("routers", "routers (the clients spread over them)"),
        ("nats-cluster", "NATS nodes per datacenter"),
    ):
        p.add_argument(
            f"--{flag}", type=int, default=1, help=f"{what}, as `pdd up --{flag}` (1..{MAX_COUNT})"
        )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/chaos.json")
    add_quiet_option(p)
    args = p.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults: {', '.join(sorted(unknown))}")
    for flag in ("prefill", "relay", "md", "routers", "nats_cluster"):
        if not 1 <= getattr(args, flag) <= MAX_COUNT:
            p.error(f"--{flag.replace('_', '-')} must be 1..{MAX_COUNT}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    save_report(run(args), args.out, table=_print, figures=_figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
