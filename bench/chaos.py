"""`pdd chaos`: faults injected into a `pdd up` system (started here) under a steady streaming load.

One system (the `small` preset), one phase per fault. Each phase runs `--requests` streamed,
greedy completions, `--concurrency` at a time, alternating the two pipelines (p-md and
p-rld-md, forced), over a fixed pool of prompts; `--fault-at` seconds into the phase the fault
is injected. A first phase with no fault records every prompt's undisturbed output, the
reference each later stream is compared with, token by token.

Faults: SIGKILL of prefill, relay and main decode (`pdd up` restarts them); SIGSTOP of main
decode for 5 s; a restart (SIGKILL) of each NATS server; a 5 s cut of the NATS gateway (both
directions); a 2 s cut of the bulk KV link; a router restart (SIGKILL: the clients' HTTP
connections to it break, so those streams end with a connection error, never a hang).

Per fault: requests completed, migrated (moved by token IDs), failed with a clear error, hung
(no end within --hang-s), streams with tokens duplicated or missing, completed outputs unlike
the undisturbed run, KV blocks and requests still held once the system settled, time until a
fresh request succeeds again, p99 longest gap between two chunks of a migrated stream.

    pdd chaos [--requests 32] [--concurrency 16] [--max-tokens 96] [--faults kill-md,...]

Writes bench/out/chaos.json and bench/out/chaos.png.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.client import Timed, pct, random_tokens, stream_completion
from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.supervisor import read_pid
from pdd.system import RunningSystem, start_system

PIPELINES = ("p-md", "p-rld-md")


# ---- faults ---------------------------------------------------------------------------
def _signal(system: RunningSystem, name: str, sig: signal.Signals) -> None:
    pid = read_pid(system.workdir, name)
    if pid is None:
        raise RuntimeError(f"{name} is not running (no pid file)")
    os.kill(pid, sig)


def _kill(name: str) -> Callable[[RunningSystem], None]:
    return lambda system: _signal(system, name, signal.SIGKILL)


def _stop_md(system: RunningSystem) -> None:
    _signal(system, "main_decode", signal.SIGSTOP)
    try:
        time.sleep(5.0)
    finally:
        _signal(system, "main_decode", signal.SIGCONT)


def _cut(links: tuple[str, ...], seconds: float) -> Callable[[RunningSystem], None]:
    def run(system: RunningSystem) -> None:
        for link in links:
            system.wan(link, cut=True, cut_mode="drop")
        try:
            time.sleep(seconds)
        finally:
            for link in links:
                system.wan(link, cut=False)

    return run


FAULTS: dict[str, Callable[[RunningSystem], None]] = {
    "kill-prefill": _kill("prefill"),
    "kill-relay": _kill("relay"),
    "kill-md": _kill("main_decode"),
    "stop-md-5s": _stop_md,
    "restart-nats-a": _kill("nats-a"),
    "restart-nats-b": _kill("nats-b"),
    "cut-gateway-5s": _cut(("gw-ab", "gw-ba"), 5.0),
    "cut-bulk-2s": _cut(("bulk",), 2.0),
    "restart-router": _kill("router"),
}
NO_FAILURE_EXPECTED = ("restart-nats-a", "restart-nats-b", "cut-gateway-5s", "cut-bulk-2s", "stop-md-5s")


# ---- load -----------------------------------------------------------------------------
def _run_load(
    system: RunningSystem,
    args: argparse.Namespace,
    prompts: list[list[int]],
    n: int,
    name: str,
    fault: Callable[[RunningSystem], None] | None,
) -> tuple[list[tuple[int, Timed]], float | None]:
    """n streams (prompt index, result); the fault runs `fault_at` s in, while a probe measures
    how long until a fresh request succeeds again (None without a fault)."""
    recovery: list[float | None] = []

    def inject() -> None:
        time.sleep(args.fault_at)
        probe = threading.Thread(target=lambda: recovery.append(_recovery_s(system, time.monotonic())))
        probe.start()
        fault(system)
        probe.join()

    def one(i: int) -> tuple[int, Timed]:
        k = i % len(prompts)
        with httpx.Client(base_url=system.router_url) as client:
            t = stream_completion(
                client, prompts[k], args.max_tokens, pipeline=pipeline_of(k), timeout=args.hang_s
            )
        advance()
        return k, t

    injector = threading.Thread(target=inject) if fault else None
    if injector:
        injector.start()
    with progress(name, total=n) as advance, ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, range(n)))
    if injector:
        injector.join()
    return results, recovery[0] if recovery else None


def _recovery_s(system: RunningSystem, since: float, timeout_s: float = 120.0) -> float | None:
    """Seconds from `since` (the fault) until a fresh short request succeeds (None: not within
    timeout_s). The first probe waits a moment: the fault must have landed first."""
    time.sleep(0.5)
    while time.monotonic() - since < timeout_s:
        try:
            r = httpx.post(
                f"{system.router_url}/v1/completions",
                timeout=30,
                json={"prompt": "probe", "max_tokens": 2, "temperature": 0},
            )
            if r.status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return None


def _settle(system: RunningSystem, timeout_s: float = 60.0) -> dict[str, int]:
    """Wait for every instance to hold no request and no KV block; what is left after timeout_s."""
    deadline, left = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            view = system.instances()
        except httpx.HTTPError:
            view = {}
        left = {
            "held": sum(v["held"] for v in view.values()),
            "blocks": sum(v["used_blocks"] for v in view.values()),
        }
        if len({k.split("/")[0] for k in view}) == 3 and not any(left.values()):
            break
        time.sleep(0.5)
    return left


# ---- scoring --------------------------------------------------------------------------
def pipeline_of(prompt: int) -> str:
    """Each prompt always takes the same (forced) pipeline; the pool alternates them."""
    return PIPELINES[prompt % 2]


def _outcomes(results: list[tuple[int, Timed]], hang_s: float) -> dict[str, int]:
    completed = [t for _, t in results if t.ok and t.end < hang_s]
    return {
        "requests": len(results),
        "completed": len(completed),
        "migrated": sum(bool((t.pdd or {}).get("migrations")) for t in completed),
        "failed_clear": sum(not t.ok and t.end < hang_s for _, t in results),
        "hung": sum(t.end >= hang_s for _, t in results),
    }


def _score(results: list[tuple[int, Timed]], reference: dict[int, list[int]], hang_s: float) -> dict:
    completed = [t for _, t in results if t.ok and t.end < hang_s]
    migrated = [t for t in completed if (t.pdd or {}).get("migrations")]
    done = {id(t) for t in completed}
    return {
        **_outcomes(results, hang_s),
        "by_pipeline": {
            p: _outcomes([(k, t) for k, t in results if pipeline_of(k) == p], hang_s) for p in PIPELINES
        },
        # Tokens missing or repeated: the stream is not a prefix of its reference.
        "broken_streams": sum(t.token_ids != reference[k][: len(t.token_ids)] for k, t in results),
        "mismatched": sum(id(t) in done and t.token_ids != reference[k] for k, t in results),
        "errors": sorted({(t.error or "")[:120] for _, t in results if not t.ok})[:5],
        "migrated_max_gap_p99_s": pct([t.max_gap for t in migrated], 99),
        "max_gap_p99_s": pct([t.max_gap for t in completed], 99),
    }


def _phase(
    system: RunningSystem,
    args: argparse.Namespace,
    prompts: list[list[int]],
    name: str,
    reference: dict[int, list[int]],
) -> dict:
    print(f"[{name}] {args.requests} streams, {args.concurrency} at a time ...", flush=True)
    results, recovery = _run_load(system, args, prompts, args.requests, f"[{name}]", FAULTS[name])
    row = _score(results, reference, args.hang_s)
    row["recovery_s"] = recovery
    with progress(f"[{name}] settling"):
        row["left_after_settling"] = _settle(system)
    print(
        f"[{name}] completed {row['completed']} (migrated {row['migrated']}), failed {row['failed_clear']}, "
        f"hung {row['hung']}, broken {row['broken_streams']}, mismatched {row['mismatched']}, "
        f"recovery {row['recovery_s']}",
        flush=True,
    )
    return row


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [random_tokens(rng, rng.randrange(64, 400)) for _ in range(args.prompts)]
    workdir = Path(tempfile.mkdtemp(prefix="pdd-chaos-"))
    t0 = time.monotonic()
    with progress("starting pdd up"):
        system = start_system(
            workdir,
            {"PDD_ROUTER_TOKEN_TIMEOUT_S": "60"},
            model_preset=args.preset,
            delay_ms=args.delay_ms,
            bandwidth_mbps=args.bandwidth_mbps,
            timeout_s=300,
        )
    try:
        base, _ = _run_load(system, args, prompts, 2 * len(prompts), "[none] reference", None)
        reference = {k: t.token_ids for k, t in base if t.ok}
        if len(reference) < len(prompts):
            raise RuntimeError(f"the undisturbed run failed: {[t.error for _, t in base if not t.ok][:3]}")
        rows = {"none": _score(base, reference, args.hang_s)}
        for name in args.faults.split(","):
            rows[name] = _phase(system, args, prompts, name, reference)
    finally:
        system.stop()
    return {"config": vars(args), "faults": rows, "targets": _targets(rows), "wall_s": time.monotonic() - t0}


def _targets(rows: dict[str, dict]) -> list[dict]:
    total = lambda key: sum(r.get(key, 0) for r in rows.values())  # noqa: E731
    left = sum(sum((r.get("left_after_settling") or {}).values()) for r in rows.values())
    quiet = sum(rows[f]["failed_clear"] + rows[f]["hung"] for f in NO_FAILURE_EXPECTED if f in rows)
    gaps = [r["migrated_max_gap_p99_s"] for r in rows.values() if r.get("migrated")]
    return [
        {"what": "hung requests (0)", "value": total("hung"), "met": total("hung") == 0},
        {
            "what": "streams with tokens missing or repeated (0)",
            "value": total("broken_streams"),
            "met": total("broken_streams") == 0,
        },
        {
            "what": "completed outputs unlike the undisturbed run (0)",
            "value": total("mismatched"),
            "met": total("mismatched") == 0,
        },
        {"what": "requests or KV blocks held after settling (0)", "value": left, "met": left == 0},
        {
            "what": "failed requests under NATS restart / gateway or bulk cut / MD pause (0)",
            "value": quiet,
            "met": quiet == 0,
        },
        {
            "what": "p99 longest gap of a migrated stream (<= 2 s)",
            "value": max(gaps) if gaps else None,
            "met": (max(gaps) <= 2.0) if gaps else None,
        },
    ]


def _print_matrix(result: dict) -> None:
    """fault x pipeline -> completed (moved) / failed / hung."""
    print(f"\n{'fault':16}" + "".join(f" {p:>22}" for p in PIPELINES))
    for name, r in result["faults"].items():
        cells = [r["by_pipeline"][p] for p in PIPELINES]
        print(
            f"{name:16}"
            + "".join(
                f" {c['completed']:>4} ok ({c['migrated']:>2} moved) {c['failed_clear']:>2}F {c['hung']}H"
                for c in cells
            )
        )


def _print(result: dict) -> None:
    print(
        f"\n{'fault':16} {'done':>5} {'moved':>5} {'failed':>6} {'hung':>4} {'broken':>6} {'diff':>4} "
        f"{'left':>5} {'recover s':>9}"
    )
    for name, r in result["faults"].items():
        left = sum((r.get("left_after_settling") or {}).values())
        rec = r.get("recovery_s")
        print(
            f"{name:16} {r['completed']:5} {r['migrated']:5} {r['failed_clear']:6} {r['hung']:4} "
            f"{r['broken_streams']:6} {r['mismatched']:4} {left:5} {rec if rec is None else f'{rec:9.1f}'}"
        )
    _print_matrix(result)


def _figure(result: dict):
    plt = pyplot()
    names = list(result["faults"])
    rows = [result["faults"][n] for n in names]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    done = [r["completed"] - r["migrated"] for r in rows]
    moved = [r["migrated"] for r in rows]
    failed = [r["failed_clear"] for r in rows]
    ax.barh(names, done, label="completed in place")
    ax.barh(names, moved, left=done, label="completed after a move")
    ax.barh(
        names,
        failed,
        left=[a + b for a, b in zip(done, moved, strict=True)],
        label="failed: error, or the connection broke",
    )
    ax.set_xlabel("requests")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/chaos.json")
    add_quiet_option(p)
    args = p.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    save_report(run(args), args.out, table=_print, figures=_figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
