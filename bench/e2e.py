"""End-to-end benchmark against real `pdd up` systems (small preset, emulated WAN), client side.

Scenarios:
  single   (issue #4) one long, uncached prompt whose KV takes seconds to cross the WAN,
           1000 output tokens: P→MD vs P→RLD→MD vs the same request with no WAN delay
           or cap, in one run (rounds rotate the order). TTFT, time to the 2nd token,
           max inter-token gap, RLD share of the output tokens.
  agentic  (default) multi-turn agent sessions against three deployments side by side:
             same-dc  PD with no WAN delay or cap (P→MD forced: same-DC PD has no relay)
             naive    cross-DC PD: P→MD forced, every request's missing KV over the WAN
             pdd      cross-DC PDD: the router's policy picks P→MD or P→RLD→MD
           The three systems run at once; the workload runs in waves and each wave runs on
           each deployment in turn (rotating order), so machine noise hits all three alike.

Every ratio (a deployment or variant over another: p50 / p99 of TTFT, 2nd token, max gap, TPOT;
SLA goodput) is printed and written with its 90% bootstrap interval, "×0.62 [0.51–0.74]", and
"n.s." where the interval contains 1; targets on a ratio are judged on the interval (met /
likely / MISSED: bench/bootstrap.py). Requests are paired across deployments by planned step
(agentic) or by round (single).

In this system P streams the first token itself, straight after prefill, so TTFT never
includes the KV crossing the WAN; where P→MD waits for the KV shows in the time to the
2nd token and in the max inter-token gap, which are reported next to TTFT.

    python -m bench.e2e [--scenario agentic|single] [--quick] [options; see --help]

Writes bench/out/e2e_<scenario>.json (+ e2e_agentic_ttft_cdf.png, e2e_agentic_by_hit.png); its
"cpu" holds, per deployment (variant), the CPU seconds of each process over that deployment's
timed runs and the host's busy CPU seconds (pdd/benchkit/cpu.py), which `pdd sim validate` charges.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bench.bootstrap import Interval, fmt, percentile, ratio_interval, ratio_of_sums, resolves, verdict
from bench.client import (
    WAN_LINKS,
    Timed,
    pct,
    random_tokens,
    service_env,
    set_wan,
    start_systems,
    stop_all,
    stream_completion,
    wan_counters,
)
from pdd.benchkit.cpu import Meter
from pdd.benchkit.progress import Advance, add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.sim.agentic import AgenticParams, Step, make_plans, prompt_shape

KV_BYTES_PER_TOKEN = 16 * 1024  # small preset, fp32
BLOCK = 16


def _rotate(xs: list, r: int) -> list:
    r %= len(xs)
    return xs[r:] + xs[:r]


def _ms(x: float) -> str:
    return "   -  " if x is None or math.isnan(x) else f"{x * 1000:6.0f}"


# ====================================================================== single (issue #4)

SINGLE_VARIANTS = {
    # name: (WAN on?, forced pipeline, catchup_threshold override)
    "no-wan": (False, "p-md", None),
    "p-md": (True, "p-md", None),
    "p-rld-md": (True, "p-rld-md", None),
    "p-rld-md/one-shot": (True, "p-rld-md", 100_000),
    "p-rld-md/catch-up-16": (True, "p-rld-md", 16),  # smaller final batch, shorter MD stall
}
DEFAULT_SINGLE = "no-wan,p-md,p-rld-md,p-rld-md/one-shot"


def run_single(args: argparse.Namespace) -> dict:
    env = service_env(
        args.torch_threads, md_kv_mb=256, prefill_kv_mb=256, relay_kv_mb=256, prefill_chunk=args.prefill_chunk
    )
    variants = args.variants.split(",")
    for v in variants:
        if v not in SINGLE_VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(SINGLE_VARIANTS)}")
    kv_bytes = (args.prompt_tokens // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN
    nominal_s = (
        kv_bytes * 8 / (args.bandwidth_mbps * 1e6) if args.bandwidth_mbps else 0
    ) + args.delay_ms / 1000
    print(
        f"single: prompt {args.prompt_tokens} tokens (KV {kv_bytes / 2**20:.0f} MiB: {nominal_s:.2f} s at "
        f"{args.bandwidth_mbps:g} Mbit/s + {args.delay_ms:g} ms), {args.output_tokens} output tokens, "
        f"{args.rounds} round(s) of {', '.join(variants)}",
        flush=True,
    )
    t_start = time.monotonic()
    systems = start_systems(
        {
            "pdd": dict(
                env=env, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, bandwidth_mbps=args.bandwidth_mbps
            )
        }
    )
    system = systems["pdd"]
    print(f"  system up in {time.monotonic() - t_start:.0f} s", flush=True)
    rows: list[dict] = []
    meter = Meter(systems)
    try:
        with httpx.Client(base_url=system.router_url) as client:
            for i, pipeline in enumerate(("p-md", "p-rld-md")):  # warm both paths (torch, connections)
                stream_completion(
                    client,
                    random_tokens(random.Random(10_000 + i), args.prompt_tokens),
                    48,
                    pipeline=pipeline,
                )
            with progress("single", total=args.rounds * len(variants)) as advance:
                for r in range(args.rounds):
                    for v in _rotate(variants, r):
                        with meter.measure(v, "pdd"):
                            timed = _single_request(args, system, client, v, r)
                        row = _single_row(v, r, timed)
                        rows.append(row)
                        advance()
                        print(
                            f"  round {r} {v:18s} ttft {_ms(row['ttft'])} ms  2nd token {_ms(row['tt2t'])} ms  "
                            f"max gap {_ms(row['max_gap'])} ms  rld {row['rld_tokens']}/{row['n_tokens']}  "
                            f"{row['pipeline']} {row['handoff_mode'] or ''}{' ERROR ' + str(row['error']) if row['error'] else ''}",
                            flush=True,
                        )
                        time.sleep(1.0)  # let the relay and MD settle (load reports, cache events)
    finally:
        system.stop()
    summary = _single_summary(rows, variants)
    ratios = _single_ratios(rows, variants)
    return {
        "scenario": "single",
        "config": _config(args),
        "kv_bytes": kv_bytes,
        "nominal_transfer_s": nominal_s,
        "rows": rows,
        "summary": summary,
        "ratios": ratios,
        "targets": _single_targets(summary, ratios, nominal_s),
        "cpu": meter.as_json(),
    }


def _single_request(args: argparse.Namespace, system, client: httpx.Client, variant: str, r: int) -> Timed:
    """One timed request of a variant; the no-WAN variant lifts delay and cap for its duration."""
    on, pipeline, threshold = SINGLE_VARIANTS[variant]
    prompt = random_tokens(random.Random(f"{args.seed}-{r}-{variant}"), args.prompt_tokens)
    if not on:
        set_wan(system, delay_ms=0, jitter_ms=0, bandwidth_mbps=None)
    try:
        return stream_completion(
            client, prompt, args.output_tokens, pipeline=pipeline, catchup_threshold=threshold
        )
    finally:
        if not on:
            set_wan(
                system, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, bandwidth_mbps=args.bandwidth_mbps
            )


def _single_summary(rows: list[dict], variants: list[str]) -> dict:
    """Per variant, the medians over its successful rounds."""
    summary = {}
    for v in variants:
        rs = [x for x in rows if x["variant"] == v and x["ok"]]
        if not rs:
            continue
        summary[v] = {
            k: statistics.median([x[k] for x in rs])
            for k in (
                "ttft",
                "tt2t",
                "max_gap",
                "tpot",
                "total",
                "rld_tokens",
                "n_tokens",
                "wan_bytes",
                "rld_share",
            )
        }
        summary[v]["handoff_mode"] = rs[0]["handoff_mode"]
        summary[v]["pipeline"] = rs[0]["pipeline"]
        summary[v]["runs"] = len(rs)
    return summary


def _single_row(variant: str, r: int, t: Timed) -> dict:
    p = t.pdd
    return {
        "variant": variant,
        "round": r,
        "ok": t.ok,
        "error": t.error,
        "pipeline": p.get("pipeline"),
        "ttft": t.ttft,
        "tt2t": t.time_to_token(2),
        "max_gap": t.max_gap,
        "tpot": t.tpot,
        "total": t.end,
        "n_tokens": t.n_tokens,
        "rld_tokens": p.get("rld_tokens", 0),
        "md_tokens": p.get("md_tokens", 0),
        "rld_share": p.get("rld_tokens", 0) / max(t.n_tokens, 1),
        "handoff_mode": p.get("handoff_mode"),
        "handoff_batches": p.get("handoff_batches", 0),
        "wan_bytes": p.get("wan_bytes", 0),
        "gap_p99": pct(t.gaps, 99) if t.gaps else 0.0,
    }


SINGLE_RATIO_KEYS = ("ttft", "tt2t", "max_gap", "tpot")


def _single_ratios(rows: list[dict], variants: list[str]) -> dict:
    """Each variant over no-WAN, and each relayed variant over P→MD: ratios of medians over the
    rounds with 90% bootstrap intervals, paired by round (a round runs its variants back to back,
    so they share the host's load of that moment)."""
    comparisons = [(v, "no-wan") for v in variants if v != "no-wan" and "no-wan" in variants]
    if "p-md" in variants:
        comparisons += [(v, "p-md") for v in variants if v.startswith("p-rld-md")]
    out = {}
    for x, y in comparisons:
        xs, ys = _pairs(rows, "variant", x, y, "round")
        out[f"{x}/{y}"] = {k: _ratio(xs, ys, k, 50) for k in SINGLE_RATIO_KEYS}
    return out


def _single_targets(s: dict, ratios: dict, nominal_s: float) -> list[dict]:
    out = []
    base = s.get("no-wan")
    if base is None:
        return out
    for v in SINGLE_VARIANTS:
        if not v.startswith("p-rld-md") or v not in s:
            continue
        for k, label in (("ttft", "TTFT"), ("max_gap", "max inter-token gap")):
            out.append(_ratio_target(f"{v} {label} within 1.5x of no-WAN", ratios[f"{v}/no-wan"][k], 1.5))
        full = s[v]["n_tokens"] >= 1000  # the target is stated for a 1000-token output
        out.append(
            {
                "what": f"{v} RLD share of output tokens <= 10%"
                + ("" if full else " (for 1000-token outputs)"),
                "value": f"{s[v]['rld_share']:.1%} ({s[v]['rld_tokens']:.0f} of {s[v]['n_tokens']:.0f})",
                "met": s[v]["rld_share"] <= 0.10 if full else None,
            }
        )
    if "p-md" in s:
        # P→MD's first decode-side token must wait for the whole KV: the 2nd token comes after
        # the transfer time (the transfer overlaps prefill, so the stall after token 1 is shorter).
        grow_gap = s["p-md"]["max_gap"] - base["max_gap"]
        out.append(
            {
                "what": "P→MD waits for the KV: 2nd token after the transfer time (stall = transfer - prefill)",
                "value": f"2nd token {s['p-md']['tt2t']:.2f} s vs {nominal_s:.2f} s on the wire; "
                f"max gap +{grow_gap:.2f} s vs no-WAN",
                "met": s["p-md"]["tt2t"] >= 0.9 * nominal_s,
            }
        )
        out.append(
            {
                "what": "P→MD TTFT (P streams the 1st token itself)",
                "value": f"{_fmt(ratios['p-md/no-wan']['ttft'])} of no-WAN",
                "met": None,
            }
        )
    return out


def _print_single(res: dict) -> None:
    print(
        f"\nsingle request: prompt {res['config']['prompt_tokens']} tokens uncached "
        f"(KV {res['kv_bytes'] / 2**20:.0f} MiB, {res['nominal_transfer_s']:.2f} s nominal on the WAN), "
        f"{res['config']['output_tokens']} output tokens; medians of {res['config']['rounds']} round(s)"
    )
    print(
        f"  {'variant':18s} {'TTFT':>7s} {'2nd tok':>7s} {'max gap':>7s} {'TPOT':>6s} {'total':>7s}  "
        f"{'RLD share':>9s}  handoff"
    )
    for v, s in res["summary"].items():
        print(
            f"  {v:18s} {s['ttft']:6.2f}s {s['tt2t']:6.2f}s {s['max_gap']:6.2f}s {s['tpot'] * 1000:4.0f}ms "
            f"{s['total']:6.1f}s  {s['rld_share']:8.1%}  {s['handoff_mode'] or '-':9s}"
        )
    _print_ratios(
        res["ratios"],
        [("TTFT", "ttft", 50), ("2nd token", "tt2t", 50), ("max gap", "max_gap", 50), ("TPOT", "tpot", 50)],
        "of medians, resampling rounds (paired by round)",
    )


# ====================================================================== agentic

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
    results: list[Result] = []
    busy = dict.fromkeys(deps, 0.0)
    meter = Meter(systems)
    try:
        if "same-dc" in systems:
            set_wan(systems["same-dc"], delay_ms=0, jitter_ms=0, bandwidth_mbps=None)
        _warm_all(systems, shared)
        counters0 = {d: wan_counters(s) for d, s in systems.items()}
        time.sleep(1.0)
        sessions = {d: [Session() for _ in range(args.clients)] for d in deps}
        n_waves = math.ceil(max(len(p) for p in plans) / args.wave)
        with progress(f"agentic {' '.join(deps)}", total=args.requests * len(deps)) as advance:
            for w in range(n_waves):
                for d in _rotate(deps, w):
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
        link_bytes = {d: _bytes_since(s, counters0[d]) for d, s in systems.items()}
    finally:
        stop_all(systems)
    rows = [asdict(r) for r in results]
    summary = {
        d: _summarize(args, [r for r in rows if r["deployment"] == d], busy[d], link_bytes[d]) for d in deps
    }
    by_hit = {d: _by_hit([r for r in rows if r["deployment"] == d]) for d in deps}
    sweep = _goodput_sweep(args, rows, busy, deps)
    ratios = _agentic_ratios(args, rows, busy, deps)
    return {
        "scenario": "agentic",
        "config": _config(args),
        "summary": summary,
        "by_hit": by_hit,
        "goodput_sweep": sweep,
        "ratios": ratios,
        "rows": rows,
        "targets": _agentic_targets(ratios),
        "cpu": meter.as_json(),
    }


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


def _meets(r: dict, ttft_s: float, tpot_s: float, gap_s: float | None) -> bool:
    if not r["ok"] or r["ttft"] > ttft_s or r["tpot"] > tpot_s:
        return False
    return gap_s is None or r["max_gap"] <= gap_s


def _summarize(args, rows: list[dict], busy_s: float, link_bytes: dict) -> dict:
    ok = [r for r in rows if r["ok"]]
    n_out = sum(r["n_tokens"] for r in ok)
    pipes: dict[str, int] = {}
    for r in ok:
        pipes[r["pipeline"]] = pipes.get(r["pipeline"], 0) + 1
    meeting = sum(_meets(r, args.sla_ttft_s, args.sla_tpot_s, args.sla_max_gap_s) for r in rows)
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


HIT_BUCKETS = [(0.0, 0.2), (0.2, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 0.99), (0.99, 1.01)]


def _bucket_name(lo: float, hi: float) -> str:
    return f"{lo * 100:.0f}-{min(hi, 1.0) * 100:.0f}%"


def _by_hit(rows: list[dict]) -> dict:
    out = {}
    for lo, hi in HIT_BUCKETS:
        rs = [r for r in rows if r["ok"] and lo <= r["hit"] < hi]
        out[_bucket_name(lo, hi)] = {
            "n": len(rs),
            "ttft_p50": pct([r["ttft"] for r in rs], 50),
            "tt2t_p50": pct([r["tt2t"] for r in rs], 50),
            "max_gap_p50": pct([r["max_gap"] for r in rs], 50),
            "tpot_p50": pct([r["tpot"] for r in rs], 50),
        }
    return out


def _goodput_sweep(args, rows: list[dict], busy: dict, deps: list[str]) -> list[dict]:
    out = []
    for tpot in sorted({0.05, 0.1, 0.2, args.sla_tpot_s}):
        row: dict[str, Any] = {"ttft_s": args.sla_ttft_s, "tpot_s": tpot}
        for d in deps:
            met = sum(
                _meets(r, args.sla_ttft_s, tpot, args.sla_max_gap_s) for r in rows if r["deployment"] == d
            )
            row[d] = met / busy[d]
        out.append(row)
    return out


AGENTIC_RATIOS = {
    f"{k}_p{q}": (k, q) for k in ("ttft", "tt2t", "max_gap", "tpot") for q in (50, 99)
}  # name: (row key, q)


def _agentic_ratios(args, rows: list[dict], busy: dict, deps: list[str]) -> dict:
    """Each deployment over same-DC and PDD over naive: p50 and p99 ratios and SLA goodput, with
    90% bootstrap intervals over requests paired by planned step (client, step). Every deployment
    runs the same plan, so a step is the same prompt and output length on each side (greedy: the
    same tokens), and its hit rate and prompt length, which dominate its latency, move both sides
    of a pair alike."""
    comparisons = [(d, "same-dc") for d in deps if d != "same-dc" and "same-dc" in deps]
    if "pdd" in deps and "naive" in deps:
        comparisons.append(("pdd", "naive"))
    out = {}
    for x, y in comparisons:
        xs, ys = _pairs(rows, "deployment", x, y, ("client", "step"))
        out[f"{x}/{y}"] = {name: _ratio(xs, ys, k, q) for name, (k, q) in AGENTIC_RATIOS.items()}
        out[f"{x}/{y}"]["sla_goodput"] = _goodput_ratio(args, xs, ys, busy[x], busy[y])
    return out


def _goodput_ratio(args, xs: list[dict], ys: list[dict], busy_x: float, busy_y: float) -> dict:
    """SLA goodput is (requests meeting the SLA) / busy seconds, and a deployment's busy seconds
    are its agents' requests back to back: the bootstrap resamples pairs of requests and takes,
    per side, requests meeting the SLA over their summed end-to-end seconds, then scales that
    ratio to the measured one (the factor, how busy time relates to summed request time on
    each side, is held fixed)."""

    def records(rs: list[dict]) -> list[tuple[float, float]]:
        return [
            (float(_meets(r, args.sla_ttft_s, args.sla_tpot_s, args.sla_max_gap_s)), r["e2e"]) for r in rs
        ]

    met_x, met_y = (sum(m for m, _ in records(rs)) for rs in (xs, ys))
    measured = (met_x / busy_x) / (met_y / busy_y) if met_y > 0 and busy_x > 0 and busy_y > 0 else math.nan
    iv = ratio_interval(records(xs), records(ys), ratio_of_sums, paired=True)
    if not iv.point > 0:  # nobody met the SLA on a side: a ratio of 0 or none, no interval
        return {"ratio": measured, "lo": math.nan, "hi": math.nan, "n": len(xs)}
    return {**iv.scaled(measured / iv.point).as_json(), "n": len(xs)}


def _agentic_targets(ratios: dict) -> list[dict]:
    out = []
    if "pdd/naive" in ratios:
        r = ratios["pdd/naive"]
        for k, label in (
            ("tt2t_p99", "p99 time to 2nd token"),
            ("max_gap_p99", "p99 max inter-token gap"),
            ("ttft_p50", "TTFT p50"),
            ("ttft_p99", "TTFT p99"),
        ):
            out.append(
                _ratio_target(
                    f"PDD vs naive cross-DC: {label} at most naive's", r[k], 1.0, q=AGENTIC_RATIOS[k][1]
                )
            )
        out.append(
            _ratio_target(
                "PDD vs naive cross-DC: SLA goodput at least naive's", r["sla_goodput"], 1.0, at_most=False
            )
        )
    if "pdd/same-dc" in ratios:
        out.append(
            {
                "what": "PDD vs same-DC PD: SLA goodput",
                "value": _fmt(ratios["pdd/same-dc"]["sla_goodput"]),
                "met": None,
            }
        )
    return out


def _print_agentic(res: dict) -> None:
    c = res["config"]
    s = res["summary"]
    deps = list(s)
    print(
        f"\nagentic: {c['requests']} requests per deployment, {c['clients']} agents; WAN {c['delay_ms']:g} ms "
        f"one way ±{c['jitter_ms']:g} ms, {c['bandwidth_mbps']:g} Mbit/s; SLA TTFT <= {c['sla_ttft_s']:g} s, "
        f"TPOT <= {c['sla_tpot_s'] * 1000:g} ms"
        + (f", max gap <= {c['sla_max_gap_s']:g} s" if c["sla_max_gap_s"] else "")
    )
    w = 12
    print("  " + f"{'':26s}" + "".join(f"{d:>{w}s}" for d in deps))

    def row(label: str, fmt, key: str) -> None:
        print("  " + f"{label:26s}" + "".join(f"{fmt(s[d][key]):>{w}s}" for d in deps))

    def ms(x):
        return f"{x * 1000:.0f} ms"

    row("requests ok", lambda x: str(x), "ok")
    row("mean prefix hit", lambda x: f"{x:.1%}", "hit_mean")
    row("requests > 95% hit", lambda x: f"{x:.0%}", "hit_above_95")
    row("TTFT p50", ms, "ttft_p50")
    row("TTFT p99", ms, "ttft_p99")
    row("2nd token p50", ms, "tt2t_p50")
    row("2nd token p99", ms, "tt2t_p99")
    row("max inter-token gap p50", ms, "max_gap_p50")
    row("max inter-token gap p99", ms, "max_gap_p99")
    row("TPOT p50", ms, "tpot_p50")
    row("TPOT p99", ms, "tpot_p99")
    row("throughput (req/s)", lambda x: f"{x:.3f}", "rps")
    row("SLA goodput (req/s)", lambda x: f"{x:.3f}", "sla_goodput_rps")
    row("KV bytes MD received", lambda x: f"{x / 2**20:.0f} MiB", "wan_bytes")
    row("KV bytes per request", lambda x: f"{x / 2**10:.0f} KiB", "wan_bytes_per_request")
    row("bulk link bytes", lambda x: f"{x / 2**20:.0f} MiB", "bulk_link_bytes")
    row("RLD token share", lambda x: f"{x:.1%}", "rld_token_share")
    print(
        "  "
        + f"{'pipelines':26s}"
        + "".join(
            f"{' '.join(f'{k}:{v}' for k, v in sorted(s[d]['pipelines'].items())):>{w + 14}s}"
            if i == 0
            else f"  {' '.join(f'{k}:{v}' for k, v in sorted(s[d]['pipelines'].items()))}"
            for i, d in enumerate(deps)
        )
    )
    _print_ratios(
        res["ratios"],
        [
            (f"{label} p{q}", f"{k}_p{q}", q)
            for label, k in (
                ("TTFT", "ttft"),
                ("2nd token", "tt2t"),
                ("max gap", "max_gap"),
                ("TPOT", "tpot"),
            )
            for q in (50, 99)
        ]
        + [("SLA goodput", "sla_goodput", 50)],
        "resampling requests (paired by planned step)",
    )
    _print_by_hit_and_goodput(res)


def _print_by_hit_and_goodput(res: dict) -> None:
    c = res["config"]
    deps = list(res["summary"])
    print("\n  by prefix hit rate (median TTFT / 2nd token / max gap, ms; n):")
    for b in res["by_hit"][deps[0]]:
        cells = []
        for d in deps:
            x = res["by_hit"][d][b]
            cells.append(
                f"{d}: {_ms(x['ttft_p50']).strip()}/{_ms(x['tt2t_p50']).strip()}/"
                f"{_ms(x['max_gap_p50']).strip()} (n={x['n']})"
            )
        print(f"    {b:>8s}  " + "   ".join(cells))
    print(f"\n  SLA goodput (req/s) vs TPOT limit (TTFT <= {c['sla_ttft_s']:g} s):")
    for r in res["goodput_sweep"]:
        print(f"    TPOT <= {r['tpot_s'] * 1000:4.0f} ms  " + "  ".join(f"{d} {r[d]:.3f}" for d in deps))


def _agentic_figures(res: dict) -> dict:
    return {"ttft_cdf": _latency_cdf_figure(res), "by_hit": _by_hit_figure(res)}


def _latency_cdf_figure(res: dict):
    import matplotlib.ticker
    import numpy as np

    rows = res["rows"]
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (axes[0], "ttft", "TTFT (1st token, streamed by P)"),
        (axes[1], "tt2t", "time to 2nd token (1st decode-side token)"),
    ):
        for d in res["summary"]:
            xs = np.sort(
                [r[key] for r in rows if r["deployment"] == d and r["ok"] and not math.isnan(r[key])]
            )
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=d, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("seconds")
        ax.set_ylabel("CDF")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right")
    return fig


def _by_hit_figure(res: dict):
    import numpy as np

    deps = list(res["summary"])
    buckets = list(res["by_hit"][deps[0]])
    fig, axes = pyplot().subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(deps)
    x = np.arange(len(buckets))
    for ax, key, title in (
        (axes[0], "ttft_p50", "median TTFT by prefix hit rate"),
        (axes[1], "max_gap_p50", "median max inter-token gap by prefix hit rate"),
    ):
        for i, d in enumerate(deps):
            ys = [res["by_hit"][d][b][key] for b in buckets]
            ax.bar(
                x + (i - (len(deps) - 1) / 2) * width, [0 if math.isnan(y) else y for y in ys], width, label=d
            )
        ax.set_xticks(
            x,
            [f"{b}\n(n={'/'.join(str(res['by_hit'][d][b]['n']) for d in deps)})" for b in buckets],
            fontsize=8,
        )
        ax.set_xlabel("prefix hit rate at MD")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    return fig


# ====================================================================== ratios


def _pairs(
    rows: list[dict], side: str, x: str, y: str, key: tuple[str, ...] | str
) -> tuple[list[dict], list[dict]]:
    """The rows of side x and of side y that share a pair key, aligned (by key)."""
    fields = (key,) if isinstance(key, str) else key
    by = {d: {tuple(r[f] for f in fields): r for r in rows if r[side] == d} for d in (x, y)}
    keys = sorted(by[x].keys() & by[y].keys())
    return [by[x][k] for k in keys], [by[y][k] for k in keys]


def _ratio(xs: list[dict], ys: list[dict], key: str, q: float) -> dict:
    """The q-th percentile of `key` over xs / over ys (successful requests), paired, as JSON;
    n: the pairs where both sides succeeded."""

    def values(rs: list[dict]) -> list[float]:
        return [r[key] if r["ok"] and r[key] is not None else math.nan for r in rs]

    a, b = values(xs), values(ys)
    n = sum(not (math.isnan(u) or math.isnan(v)) for u, v in zip(a, b, strict=True))
    return {**ratio_interval(a, b, percentile(q), paired=True).as_json(), "n": n}


def _fmt(ratio: dict) -> str:
    return fmt(Interval.from_json(ratio))


def _ratio_target(what: str, ratio: dict, goal: float, *, q: float = 50, at_most: bool = True) -> dict:
    """A goal on a ratio of q-th percentiles (or means: q = 50), judged on its interval and on
    whether its n resolves the percentile (bench/bootstrap.py: met / likely / MISSED)."""
    v = verdict(Interval.from_json(ratio), goal, at_most=at_most, resolved=resolves(q, ratio["n"]))
    return {"what": what, "value": _fmt(ratio), "met": v == "met", "verdict": v}


def _print_ratios(ratios: dict, metrics: list[tuple[str, str, float]], design: str) -> None:
    """The ratio table; metrics: (label, key, percentile) (a mean counts as the 50th)."""
    if not ratios:
        return
    n = max(r["n"] for rs in ratios.values() for r in rs.values())
    w = 26
    print(f"\n  ratios with 90% bootstrap intervals, {design}, n = {n} (n.s.: the interval contains 1)")
    short = [label for label, _, q in metrics if not resolves(q, n)]
    if short:
        print(
            f"  (n = {n} does not resolve {', '.join(short)}: those intervals understate the uncertainty, and a"
            " target on them is 'likely' at best)"
        )
    print("  " + f"{'':16s}" + "".join(f"{c:>{w}s}" for c in ratios))
    for label, key, _ in metrics:
        print("  " + f"{label:16s}" + "".join(f"{_fmt(r[key]):>{w}s}" for r in ratios.values()))


# ====================================================================== common


def _config(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k != "out"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdd bench e2e",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--scenario", choices=["agentic", "single"], default="agentic")
    p.add_argument("--quick", action="store_true", help="a shorter run (about a minute and a half)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of each service (0 = torch's default); 3 engines share this host's cores",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="P's tokens of one prompt per forward, so KV streams while the prompt is prefilled (0 = system default)",
    )
    g = p.add_argument_group("WAN (cross-DC deployments)")
    g.add_argument("--delay-ms", type=float, default=15.0, help="one-way delay (RTT = 2x)")
    g.add_argument("--jitter-ms", type=float, default=2.0)
    g.add_argument(
        "--bandwidth-mbps",
        type=float,
        default=100.0,
        help="scaled to the small model: 2048 tokens of KV (32 MiB) take 2.7 s",
    )
    g = p.add_argument_group("single")
    g.add_argument("--prompt-tokens", type=int, default=2048)
    g.add_argument("--output-tokens", type=int, default=1000)
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--variants", default=DEFAULT_SINGLE, help=f"comma list from {', '.join(SINGLE_VARIANTS)}")
    _add_agentic_args(p.add_argument_group("agentic workload"))
    p.add_argument("--out", default=None, help="default bench/out/e2e_<scenario>.json")
    add_quiet_option(p)
    args = p.parse_args(argv)
    if args.quick:
        if args.scenario == "single":
            args.output_tokens = min(args.output_tokens, 300)
            args.rounds = 1
        else:
            args.requests = min(args.requests, 9)
            args.wave = min(args.wave, 3)
            args.output_max = min(args.output_max, 96)
    return args


def _add_agentic_args(g) -> None:
    g.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    g.add_argument("--requests", type=int, default=48, help="requests per deployment")
    g.add_argument("--clients", type=int, default=3, help="concurrent agent sessions")
    g.add_argument("--wave", type=int, default=4, help="requests per agent before switching deployment")
    g.add_argument("--shared-prefix", type=int, default=1536, help="system prompt shared by every session")
    g.add_argument("--new-min", type=int, default=1024, help="prompt tokens of a new session, min")
    g.add_argument("--new-max", type=int, default=2560, help="prompt tokens of a new session, max")
    g.add_argument("--append-min", type=int, default=8, help="tokens a continuation adds at least")
    g.add_argument(
        "--context-max", type=int, default=3584, help="prompt + output cap; a longer session restarts"
    )
    g.add_argument(
        "--high-hit-frac", type=float, default=0.75, help="share of requests aiming above --high-hit-min"
    )
    g.add_argument("--high-hit-min", type=float, default=0.95)
    g.add_argument("--output-min", type=int, default=32)
    g.add_argument("--output-max", type=int, default=192)
    g.add_argument("--outlier-frac", type=float, default=0.04, help="long-input short-output requests")
    g.add_argument("--outlier-input", type=int, default=3072)
    g.add_argument("--outlier-output", type=int, default=8)
    g.add_argument("--think-s", type=float, default=0.0, help="agent pause between turns")
    g.add_argument("--md-kv-mb", type=float, default=768, help="KV pool of MD and P (prefix caches)")
    g.add_argument(
        "--no-share-in-flight",
        dest="share_in_flight",
        action="store_false",
        help="MD asks for every block it lacks, even one already crossing for another request "
        "(only to measure what sharing saves)",
    )
    g.add_argument("--sla-ttft-s", type=float, default=2.0)
    g.add_argument("--sla-tpot-s", type=float, default=0.1)
    g.add_argument("--sla-max-gap-s", type=float, default=None, help="optional third SLA bound")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()
    if args.scenario == "single":
        res, table, figures = run_single(args), _print_single, None
    else:
        res, table, figures = run_agentic(args), _print_agentic, _agentic_figures
    res["wall_s"] = time.monotonic() - t0
    res["share_in_flight"] = getattr(args, "share_in_flight", True)
    # How contended the host was (`pdd sim validate` models it as CPU sharing).
    res["host"] = {"cores": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    save_report(res, args.out or f"bench/out/e2e_{args.scenario}.json", table=table, figures=figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
