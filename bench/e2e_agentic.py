"""bench/e2e.py's `agentic` scenario, the run: multi-turn agent sessions against three
deployments side by side (same-dc, naive cross-DC PD, pdd), in waves that rotate over the
deployments so machine noise hits all three alike; one Result per request."""

from __future__ import annotations

import argparse
import math
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

from bench.client import (
    WAN_LINKS,
    pct,
    random_tokens,
    service_env,
    set_wan,
    start_systems,
    stop_all,
    stream_completion,
    wan_counters,
)
from bench.e2e_agentic_report import agentic_ratios, agentic_targets, goodput_sweep, meets_sla, rows_by_hit
from bench.e2e_common import BLOCK, config_of
from pdd.benchkit.cpu import Meter
from pdd.benchkit.paired import rotate
from pdd.benchkit.progress import Advance, progress
from pdd.sim.workloads.agentic import AgenticParams, Step, make_plans, prompt_shape

DEPLOYMENTS = ("same-dc", "naive", "pdd")


@dataclass
class Session:
    ctx: list[int] = field(default_factory=list)  # the conversation so far (prompt + output)


def build_prompt(
    a: argparse.Namespace, step: Step, sess: Session, shared: list[int]
) -> tuple[list[int], bool]:
    """The prompt of a step given the session so far (the shared plan's shape, as tokens);
    True when it starts a new session."""
    rng = random.Random(step.seed)
    cached = (len(sess.ctx) - 1) // BLOCK * BLOCK if sess.ctx else 0  # MD holds the session's full blocks
    s = prompt_shape(AgenticParams.from_args(a), step, len(sess.ctx), cached, len(shared), BLOCK, rng)
    base = {"session": sess.ctx, "shared": shared, "none": []}[s.base][: s.keep]
    return base + random_tokens(rng, s.fresh), s.new_session


@dataclass
class Result:
    deployment: str
    client: int
    step: int
    kind: str
    target_hit: float
    prompt_tokens: int
    new_session: bool
    ok: bool
    error: str | None
    pipeline: str | None
    hit: float
    ttft: float
    tt2t: float
    max_gap: float
    tpot: float
    e2e: float
    n_tokens: int
    rld_tokens: int
    md_tokens: int
    wan_bytes: int
    handoff_mode: str | None


def sharing_env(args: argparse.Namespace) -> dict[str, str]:
    """MD's setting for --no-share-in-flight."""
    return {} if args.share_in_flight else {"PDD_MD_SHARE_IN_FLIGHT": "false"}


def run_agentic(args: argparse.Namespace) -> dict:
    deps, specs = _deployments(args)
    plans = make_plans(AgenticParams.from_args(args))
    shared = random_tokens(random.Random(f"shared-{args.seed}"), args.shared_prefix)
    print(
        f"agentic: {args.requests} requests per deployment from {args.clients} concurrent agents, waves of "
        f"{args.wave} requests per agent; WAN {args.delay_ms:g} ms one way ±{args.jitter_ms:g} ms, "
        f"{args.bandwidth_mbps:g} Mbit/s; deployments {', '.join(deps)}",
        flush=True,
    )
    t_start = time.monotonic()
    systems = start_systems(specs)
    print(f"  {len(systems)} systems up in {time.monotonic() - t_start:.0f} s", flush=True)
    meter = Meter(systems)
    try:
        if "same-dc" in systems:
            set_wan(systems["same-dc"], delay_ms=0, jitter_ms=0, bandwidth_mbps=None)
        _warm_all(systems, shared)
        counters0 = {d: wan_counters(s) for d, s in systems.items()}
        time.sleep(1.0)
        results, busy = _run_waves(args, deps, systems, plans, shared, meter)
        link_bytes = {d: _bytes_since(s, counters0[d]) for d, s in systems.items()}
    finally:
        stop_all(systems)
    rows = [asdict(r) for r in results]
    summary = {
        d: _summarize(args, [r for r in rows if r["deployment"] == d], busy[d], link_bytes[d]) for d in deps
    }
    ratios = agentic_ratios(args, rows, busy, deps)
    return {
        "scenario": "agentic",
        "config": config_of(args),
        "summary": summary,
        "by_hit": {d: rows_by_hit([r for r in rows if r["deployment"] == d]) for d in deps},
        "goodput_sweep": goodput_sweep(args, rows, busy, deps),
        "ratios": ratios,
        "rows": rows,
        "targets": agentic_targets(ratios),
        "cpu": meter.as_json(),
    }


def _deployments(args: argparse.Namespace) -> tuple[list[str], dict[str, dict]]:
    """The deployments asked for and each one's system: same-dc without the WAN's delay or cap."""
    env = service_env(
        args.torch_threads,
        md_kv_mb=args.md_kv_mb,
        prefill_kv_mb=args.md_kv_mb,
        relay_kv_mb=256,
        prefill_chunk=args.prefill_chunk,
        extra=sharing_env(args),
    )
    wan = dict(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, bandwidth_mbps=args.bandwidth_mbps)
    deps = args.deployments.split(",")
    specs = {}
    for d in deps:
        if d not in DEPLOYMENTS:
            raise SystemExit(f"unknown deployment {d!r}; choose from {', '.join(DEPLOYMENTS)}")
        specs[d] = dict(
            env=env, **(dict(delay_ms=0, jitter_ms=0, bandwidth_mbps=1000) if d == "same-dc" else wan)
        )
    return deps, specs


def _run_waves(
    args: argparse.Namespace, deps: list[str], systems: dict, plans: list, shared: list[int], meter: Meter
) -> tuple[list[Result], dict[str, float]]:
    """The planned steps in waves, each wave on every deployment in turn (the order rotates);
    the results and each deployment's busy seconds."""
    results: list[Result] = []
    busy = dict.fromkeys(deps, 0.0)
    sessions = {d: [Session() for _ in range(args.clients)] for d in deps}
    n_waves = math.ceil(max(len(p) for p in plans) / args.wave)
    with progress(f"agentic {' '.join(deps)}", total=args.requests * len(deps)) as advance:
        for w in range(n_waves):
            for d in rotate(deps, w):
                t0 = time.monotonic()
                with meter.measure(d, d):
                    results += _run_wave(args, d, systems[d], plans, sessions[d], shared, w, advance)
                busy[d] += time.monotonic() - t0
                time.sleep(0.5)
            done = sum(1 for r in results if r.deployment == deps[0])
            print(
                f"  wave {w + 1}/{n_waves}: {done} requests per deployment; busy "
                + ", ".join(f"{d} {busy[d]:.0f} s" for d in deps),
                flush=True,
            )
    return results, busy


def _warm_all(systems: dict, shared: list[int]) -> None:
    """Every deployment at once: MD caches the shared system prompt, the engines are warm."""

    def warm(d: str) -> None:
        with httpx.Client(base_url=systems[d].router_url) as c:
            # The shared system prompt is in MD's cache (steady state of a service); P→MD
            # also for PDD: through the relay, this short request would end on RLD alone
            # and MD would drop the KV (the anomalous-traffic filter).
            stream_completion(c, shared + random_tokens(random.Random(1), 64), 16, pipeline="p-md")
            if d == "pdd":  # warm the relay's engine too
                stream_completion(c, random_tokens(random.Random(2), 256), 48, pipeline="p-rld-md")

    threads = [threading.Thread(target=warm, args=(d,)) for d in systems]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _bytes_since(system, before: dict) -> dict:
    """Bytes each WAN link carried (both directions) since the `before` counters."""
    now = wan_counters(system)
    return {
        ln: now[ln]["bytes_up"] + now[ln]["bytes_down"] - before[ln]["bytes_up"] - before[ln]["bytes_down"]
        for ln in WAN_LINKS
    }


def _run_wave(
    args,
    d: str,
    system,
    plans: list[list[Step]],
    sessions: list[Session],
    shared: list[int],
    w: int,
    advance: Advance,
) -> list[Result]:
    out: list[Result] = []
    lock = threading.Lock()
    pipeline = None if d == "pdd" else "p-md"

    def agent(ci: int) -> None:
        steps = plans[ci][w * args.wave : (w + 1) * args.wave]
        sess = sessions[ci]
        with httpx.Client(base_url=system.router_url) as client:
            for j, step in enumerate(steps):
                prompt, new = build_prompt(args, step, sess, shared)
                t = stream_completion(client, prompt, step.out, pipeline=pipeline)
                if step.kind != "outlier":
                    # The agent's next turn builds on what the model said (greedy: the same
                    # tokens on every deployment).
                    sess.ctx = prompt + t.token_ids
                p = t.pdd
                r = Result(
                    d,
                    ci,
                    w * args.wave + j,
                    step.kind,
                    step.hit,
                    len(prompt),
                    new,
                    t.ok,
                    t.error,
                    p.get("pipeline") or t.pipeline_header,
                    p.get("prefix_hit_rate", math.nan),
                    t.ttft,
                    t.time_to_token(2),
                    t.max_gap,
                    t.tpot,
                    t.end,
                    t.n_tokens,
                    p.get("rld_tokens", 0),
                    p.get("md_tokens", 0),
                    p.get("wan_bytes", 0),
                    p.get("handoff_mode"),
                )
                with lock:
                    out.append(r)
                advance()
                if args.think_s > 0:
                    time.sleep(args.think_s)

    threads = [threading.Thread(target=agent, args=(ci,)) for ci in range(args.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def _summarize(args, rows: list[dict], busy_s: float, link_bytes: dict) -> dict:
    ok = [r for r in rows if r["ok"]]
    n_out = sum(r["n_tokens"] for r in ok)
    pipes: dict[str, int] = {}
    for r in ok:
        pipes[r["pipeline"]] = pipes.get(r["pipeline"], 0) + 1
    meeting = sum(meets_sla(r, args.sla_ttft_s, args.sla_tpot_s, args.sla_max_gap_s) for r in rows)
    hits = [r["hit"] for r in ok if not math.isnan(r["hit"])]
    return {
        "requests": len(rows),
        "ok": len(ok),
        "busy_s": busy_s,
        "rps": len(ok) / busy_s,
        "ttft_p50": pct([r["ttft"] for r in ok], 50),
        "ttft_p99": pct([r["ttft"] for r in ok], 99),
        "tt2t_p50": pct([r["tt2t"] for r in ok], 50),
        "tt2t_p99": pct([r["tt2t"] for r in ok], 99),
        "max_gap_p50": pct([r["max_gap"] for r in ok], 50),
        "max_gap_p99": pct([r["max_gap"] for r in ok], 99),
        "max_gap_max": max((r["max_gap"] for r in ok), default=math.nan),
        "tpot_p50": pct([r["tpot"] for r in ok], 50),
        "tpot_p99": pct([r["tpot"] for r in ok], 99),
        "sla_ok": meeting,
        "sla_goodput_rps": meeting / busy_s,
        "wan_bytes": sum(r["wan_bytes"] for r in ok),
        "wan_bytes_per_request": statistics.fmean(r["wan_bytes"] for r in ok) if ok else math.nan,
        "bulk_link_bytes": link_bytes.get("bulk", 0),
        "gateway_bytes": link_bytes.get("gw-ab", 0) + link_bytes.get("gw-ba", 0),
        "rld_token_share": sum(r["rld_tokens"] for r in ok) / max(n_out, 1),
        "output_tokens": n_out,
        "pipelines": pipes,
        "hit_mean": statistics.fmean(hits) if hits else math.nan,
        "hit_above_95": sum(h > 0.95 for h in hits) / max(len(hits), 1),
    }
