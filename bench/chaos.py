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
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.chaos_client import PIPELINES, Routers, Stream, stream_request
from bench.chaos_faults import FAULTED_ROUTER, FAULTS, ROLES, ROUTER_FAULTS, Fault
from bench.chaos_report import figure, print_report, targets_of
from bench.client import pct, random_tokens
from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import save_report
from pdd.launch import MAX_COUNT
from pdd.system import RunningSystem, start_system


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
        "targets": targets_of(rows),
        "wall_s": time.monotonic() - t0,
    }


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
    save_report(run(args), args.out, table=print_report, figures=figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
