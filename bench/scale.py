"""Scale-out benchmark: the agentic workload on one instance per role vs two per role (tiny preset).

Both deployments run side by side in one run, over an emulated WAN:

  1x1x1  one prefill, one relay, one main decoder, one router
  2x2x2  two of each, two routers (each agent talks to one of them)

Both systems run at once; the workload runs in waves, each wave on each deployment in turn
(rotating order), so machine noise hits both alike. Reported per deployment:
  - MD prefix-hit rate achieved, against an oracle that knows every MD's cache (for each
    request, the longest prefix any MD holds: what a router with a perfect view and no load
    bound would get);
  - KV bytes sent over the WAN per request (affinity preserved: the 2x2x2 fleet should not
    resend prefixes the other MD holds);
  - SLA goodput (requests meeting the TTFT / TPOT bounds per second busy);
  - requests per instance, and max/mean of each role's spread.

    pdd bench scale [--requests N] [--clients N] [options; see --help]

Writes bench/out/scale.json and scale.png.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx

from bench.client import pct, random_tokens, service_env, start_systems, stop_all, stream_completion
from bench.e2e import add_agentic_args
from bench.e2e_agentic import Session, build_prompt, sharing_env
from bench.e2e_common import BLOCK
from pdd.benchkit.paired import rotate
from pdd.benchkit.progress import Advance, add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.sim.workloads.agentic import AgenticParams, Step, make_plans
from shared.engine.hashing import block_hashes
from shared.model.presets import preset_config

DEPLOYMENTS = {"1x1x1": 1, "2x2x2": 2}
ROLES = ("prefill", "relay", "main_decode")
ORACLE_MODEL = "oracle"  # any id: the oracle compares its own hashes only


class Oracle:
    """What every MD holds, from what each was given (prompt and output of each request it
    served: MD caches both). Pools are sized so nothing is evicted during the run."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}

    def best_hit(self, prompt: list[int]) -> float:
        hashes = block_hashes(prompt, BLOCK, ORACLE_MODEL)
        best = max((_prefix_len(held, hashes) for held in self.blocks.values()), default=0)
        return best * BLOCK / len(prompt) if prompt else 0.0

    def served(self, md: str, tokens: list[int]) -> None:
        self.blocks.setdefault(md, set()).update(block_hashes(tokens, BLOCK, ORACLE_MODEL))


def _prefix_len(held: set[int], hashes: list[int]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


def run(args: argparse.Namespace) -> dict:
    env = service_env(
        args.torch_threads,
        md_kv_mb=args.md_kv_mb,
        prefill_kv_mb=args.md_kv_mb,
        relay_kv_mb=128,
        prefill_chunk=args.prefill_chunk,
        extra=sharing_env(args),
    )
    wan = dict(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, bandwidth_mbps=args.bandwidth_mbps)
    specs = {
        d: dict(env=env, model_preset=args.model_preset, prefill=n, relay=n, md=n, routers=n, **wan)
        for d, n in DEPLOYMENTS.items()
    }
    plans = make_plans(AgenticParams.from_args(args))
    shared = random_tokens(random.Random(f"shared-{args.seed}"), args.shared_prefix)
    print(
        f"scale: {args.requests} requests per deployment from {args.clients} agents, waves of {args.wave}; "
        f"deployments {', '.join(DEPLOYMENTS)}",
        flush=True,
    )
    t0 = time.monotonic()
    systems = start_systems(specs)
    print(f"  systems up in {time.monotonic() - t0:.0f} s", flush=True)
    rows: list[dict] = []
    busy = dict.fromkeys(DEPLOYMENTS, 0.0)
    oracles = {d: Oracle() for d in DEPLOYMENTS}
    sessions = {d: [Session() for _ in range(args.clients)] for d in DEPLOYMENTS}
    try:
        n_waves = math.ceil(max(len(p) for p in plans) / args.wave)
        with progress(f"scale {' '.join(DEPLOYMENTS)}", total=args.requests * len(DEPLOYMENTS)) as advance:
            for w in range(n_waves):
                for d in rotate(list(DEPLOYMENTS), w):
                    t = time.monotonic()
                    rows += _wave(
                        args, d, systems[d].router_urls, plans, sessions[d], shared, oracles[d], w, advance
                    )
                    busy[d] += time.monotonic() - t
                print(f"  wave {w + 1}/{n_waves} done", flush=True)
    finally:
        stop_all(systems)
    summary = {d: _summarize(args, [r for r in rows if r["deployment"] == d], busy[d]) for d in DEPLOYMENTS}
    return {"config": vars(args), "summary": summary, "rows": rows, "targets": _targets(summary)}


def _wave(
    args,
    d: str,
    routers: list[str],
    plans: list[list[Step]],
    sessions: list[Session],
    shared: list[int],
    oracle: Oracle,
    w: int,
    advance: Advance,
) -> list[dict]:
    out: list[dict] = []
    lock = threading.Lock()

    def agent(ci: int) -> None:
        sess = sessions[ci]
        with httpx.Client(base_url=routers[ci % len(routers)]) as client:
            for j, step in enumerate(plans[ci][w * args.wave : (w + 1) * args.wave]):
                prompt, new = build_prompt(args, step, sess, shared)
                with lock:
                    best = oracle.best_hit(prompt)
                t = stream_completion(client, prompt, step.out)
                where = t.pdd.get("instances") or {}
                if t.ok and where.get("main_decode") is not None:
                    with lock:
                        oracle.served(where["main_decode"], prompt + t.token_ids)
                if step.kind != "outlier":
                    sess.ctx = prompt + t.token_ids
                wan_bytes = t.pdd.get("wan_bytes", 0)
                row = {
                    "deployment": d,
                    "client": ci,
                    "step": w * args.wave + j,
                    "kind": step.kind,
                    "new": new,
                    "prompt_tokens": len(prompt),
                    "ok": t.ok,
                    "error": t.error,
                    "oracle_hit": best,
                    # what MD really held: the prompt's KV it did not have to receive
                    "hit": 1 - wan_bytes / (len(prompt) * args.kv_bytes_per_token),
                    "wan_bytes": wan_bytes,
                    "router_hit": t.pdd.get("prefix_hit_rate", math.nan),
                    "pipeline": t.pdd.get("pipeline"),
                    "ttft": t.ttft,
                    "tpot": t.tpot,
                    "n_tokens": t.n_tokens,
                    **{role: where.get(role) for role in ROLES},
                }
                with lock:
                    out.append(row)
                advance()

    threads = [threading.Thread(target=agent, args=(ci,)) for ci in range(args.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def spread(counts: dict[str, int], n_instances: int) -> float:
    """max/mean requests per instance (instances that got none count as zero)."""
    values = list(counts.values()) + [0] * (n_instances - len(counts))
    mean = sum(values) / n_instances if n_instances else 0.0
    return max(values) / mean if mean else math.nan


def _summarize(args, rows: list[dict], busy_s: float) -> dict:
    ok = [r for r in rows if r["ok"]]
    n = DEPLOYMENTS[rows[0]["deployment"]] if rows else 1
    weight = sum(r["prompt_tokens"] for r in ok) or 1
    hit = sum(r["hit"] * r["prompt_tokens"] for r in ok if not math.isnan(r["hit"])) / weight
    oracle = sum(r["oracle_hit"] * r["prompt_tokens"] for r in ok) / weight
    meeting = sum(r["ok"] and r["ttft"] <= args.sla_ttft_s and r["tpot"] <= args.sla_tpot_s for r in rows)
    per_role = {role: dict(Counter(r[role] for r in ok if r[role] is not None)) for role in ROLES}
    return {
        "requests": len(rows),
        "ok": len(ok),
        "busy_s": busy_s,
        "hit": hit,
        "oracle_hit": oracle,
        "hit_vs_oracle": hit / oracle if oracle else math.nan,
        "wan_bytes_per_request": statistics.fmean(r["wan_bytes"] for r in ok) if ok else math.nan,
        "sla_goodput_rps": meeting / busy_s if busy_s else 0.0,
        "ttft_p50": pct([r["ttft"] for r in ok], 50),
        "ttft_p99": pct([r["ttft"] for r in ok], 99),
        "per_instance": per_role,
        "spread": {role: spread(per_role[role], n) for role in ROLES},
    }


def _targets(s: dict) -> list[dict]:
    one, two = s["1x1x1"], s["2x2x2"]
    wan = (
        two["wan_bytes_per_request"] / one["wan_bytes_per_request"]
        if one["wan_bytes_per_request"]
        else math.nan
    )
    return [
        {
            "what": "2x2x2 MD prefix-hit rate >= 0.95x the oracle's",
            "value": f"x{two['hit_vs_oracle']:.3f} ({two['hit']:.3f} vs {two['oracle_hit']:.3f})",
            "met": two["hit_vs_oracle"] >= 0.95,
        },
        {
            "what": "2x2x2 WAN bytes per request within 1.1x of 1x1x1",
            "value": f"x{wan:.2f}",
            "met": wan <= 1.1,
        },
        {
            "what": "2x2x2 MD load max/mean <= 1.5",
            "value": f"{two['spread']['main_decode']:.2f}",
            "met": two["spread"]["main_decode"] <= 1.5,
        },
        {
            "what": "requests failed",
            "value": f"{one['requests'] - one['ok']} / {two['requests'] - two['ok']}",
            "met": one["ok"] == one["requests"] and two["ok"] == two["requests"],
        },
        {
            "what": "2x2x2 SLA goodput vs 1x1x1",
            "met": None,
            "value": f"x{two['sla_goodput_rps'] / one['sla_goodput_rps']:.2f}"
            if one["sla_goodput_rps"]
            else "-",
        },
    ]


def _table(res: dict) -> None:
    print(
        f"\n{'deployment':10s} {'ok':>7s} {'hit':>6s} {'oracle':>6s} {'WAN KB/req':>10s} {'goodput':>8s} "
        f"{'TTFT p50':>8s}  spread P/RLD/MD"
    )
    for d, s in res["summary"].items():
        sp = "/".join(f"{s['spread'][r]:.2f}" for r in ROLES)
        print(
            f"{d:10s} {s['ok']:3d}/{s['requests']:<3d} {s['hit']:6.3f} {s['oracle_hit']:6.3f} "
            f"{s['wan_bytes_per_request'] / 1024:10.1f} {s['sla_goodput_rps']:7.2f}/s {s['ttft_p50'] * 1000:6.0f}ms"
            f"  {sp}"
        )


def _figure(res: dict) -> Any:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(res["summary"])
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [res["summary"][d]["hit"] for d in names], 0.4, label="achieved")
    ax1.bar([i + 0.2 for i in x], [res["summary"][d]["oracle_hit"] for d in names], 0.4, label="oracle")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("MD prefix-hit rate")
    ax1.legend()
    loads = res["summary"]["2x2x2"]["per_instance"]
    labels = [f"{role}/{inst}" for role in ROLES for inst in sorted(loads[role])]
    ax2.bar(labels, [loads[role][inst] for role in ROLES for inst in sorted(loads[role])])
    ax2.set_ylabel("requests (2x2x2)")
    ax2.tick_params(axis="x", rotation=45)
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdd bench scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-preset", default="tiny")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=0)
    g = p.add_argument_group("WAN")
    g.add_argument("--delay-ms", type=float, default=15.0)
    g.add_argument("--jitter-ms", type=float, default=2.0)
    g.add_argument("--bandwidth-mbps", type=float, default=100.0)
    add_agentic_args(p.add_argument_group("agentic workload"))
    # A small run by default: the tiny model's contexts, more agents than instances.
    p.set_defaults(
        requests=96,
        clients=6,
        wave=4,
        shared_prefix=256,
        new_min=128,
        new_max=384,
        context_max=1024,
        outlier_input=768,
        output_min=16,
        output_max=48,
        md_kv_mb=256,
    )
    p.add_argument("--out", default="bench/out/scale.json")
    add_quiet_option(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.kv_bytes_per_token = preset_config(args.model_preset, 0).kv_bytes_per_token(4)  # float32, as served
    t0 = time.monotonic()
    res = run(args)
    res["wall_s"] = time.monotonic() - t0
    res["share_in_flight"] = args.share_in_flight
    save_report(res, args.out, table=_table, figures=_figure)
    return 0 if all(t["met"] is not False for t in res["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
