"""`pdd sim plan`: the cheapest PDD fleet (P and RLD in dc-a, MD in dc-b, one WAN line) that
meets an SLA under a workload, beside the cheapest same-DC PD fleet meeting the same SLA.

Every candidate fleet is judged by simulating the whole workload on it (pdd/sim/studies/goodput.py
probe); pdd/sim/studies/planner.py says how the search picks the few fleets it simulates.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import save_report
from pdd.sim.fleet.deployment import Deployment, LinkSpec, RoleSpec, pdd, same_dc
from pdd.sim.fleet.records import SimResult
from pdd.sim.fleet.simulator import SimSettings
from pdd.sim.hardware.chip import Chip
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.hardware.profiles import MODELS_DIR, chip, model_spec
from pdd.sim.studies import planner
from pdd.sim.studies.goodput import probe
from pdd.sim.studies.planner import Counts, Outcome, Shape
from pdd.sim.studies.sla import Sla
from pdd.sim.workloads.agentic import PAPER, agentic_open_loop, prefix_hits
from pdd.sim.workloads.trace import read_mooncake
from pdd.sim.workloads.workload import Workload

OUT = "bench/out/sim_plan.json"
BLOCK = 16  # the engine's KV block (EngineSettings.block_size)
SUMMARY_KEYS = (
    "requests",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "max_gap_p50_s",
    "max_gap_p99_s",
    "wan_gbps_mean",
    "wan_gbps_p99",
    "rld_token_share",
)


def default_model() -> str:
    return "qwen2.5-7b" if (MODELS_DIR / "qwen2.5-7b.json").exists() else "llama-3.1-8b"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdd sim plan", description=__doc__.split("\n\n")[0])
    w = ap.add_argument_group("workload")
    w.add_argument(
        "--rate", type=float, default=4.0, help="agentic (paper-scale) open loop: requests/s (default 4)"
    )
    w.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (default 120)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--trace", default=None, help="replay this Mooncake JSONL trace instead of the agentic workload"
    )
    w.add_argument(
        "--rate-scale", type=float, default=1.0, help="the trace's arrivals this many times as fast"
    )
    s = ap.add_argument_group("SLA")
    s.add_argument("--sla-ttft", type=float, default=Sla.ttft_s, help="seconds (default %(default)s)")
    s.add_argument("--sla-tpot", type=float, default=Sla.tpot_s, help="seconds (default %(default)s)")
    s.add_argument(
        "--sla-gap",
        type=float,
        default=None,
        help="longest stall between tokens, seconds (default: not held)",
    )
    s.add_argument(
        "--sla-attainment", type=float, default=Sla.attainment, help="share of requests (default %(default)s)"
    )
    f = ap.add_argument_group("fleet")
    f.add_argument("--model", default=default_model(), help="model shape (default %(default)s)")
    f.add_argument(
        "--dc-a", default="gpu-a,h100-sxm", help="candidate profiles for P and RLD (default %(default)s)"
    )
    f.add_argument("--dc-b", default="gpu-b,h200-sxm", help="candidate profiles for MD (default %(default)s)")
    f.add_argument("--wan-gbps", type=float, default=100.0, help="the cross-DC line's Gbit/s (default 100)")
    f.add_argument("--wan-ms", type=float, default=10.0, help="its one-way delay, ms (default 10)")
    f.add_argument(
        "--wan-jitter-ms", type=float, default=1.0, help="uniform jitter per crossing, ms (default 1)"
    )
    f.add_argument(
        "--wan-price", type=float, default=10.0, help="the line's USD per hour (default 10, assumed)"
    )
    f.add_argument("--max-instances", type=int, default=200, help="instances per fleet at most (default 200)")
    f.add_argument(
        "--max-evals", type=int, default=40, help="simulations per fleet kind at most (default 40)"
    )
    f.add_argument(
        "--drain", type=float, default=60.0, help="simulated seconds after the last arrival (default 60)"
    )
    ap.add_argument("--out", default=OUT, help="JSON result (default %(default)s)")
    add_quiet_option(ap)
    return ap


def make_workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        w = read_mooncake(args.trace)
        return w.at_rate(args.rate_scale) if args.rate_scale != 1.0 else w
    return agentic_open_loop(PAPER, args.rate, args.duration, BLOCK, args.seed)


@dataclasses.dataclass
class Setting:
    """Everything an evaluation needs besides the fleet."""

    workload: Workload
    model: ModelSpec
    sla: Sla
    chips: dict[str, Chip]
    wan: LinkSpec
    drain_s: float
    sim: SimSettings = dataclasses.field(default_factory=SimSettings)

    def cost(self, fleet: Counts) -> float:
        return deployment(self, fleet).cost_per_hour


def deployment(st: Setting, f: Counts) -> Deployment:
    s = f.shape
    p, d = RoleSpec(f.prefill, st.chips[s.prefill]), RoleSpec(f.decode, st.chips[s.decode])
    if s.relay is None:
        return same_dc(p, d)
    return pdd(p, RoleSpec(f.relay, st.chips[s.relay]), d, st.wan)


def evaluate(st: Setting, fleet: Counts) -> Outcome:
    pr = probe(deployment(st, fleet), st.workload, st.model, st.sla, 0.0, st.sim, st.drain_s)
    full = pr.result.summary()
    summary = {k: full[k] for k in SUMMARY_KEYS}
    busy = utilisation(pr.result, fleet)
    summary["utilisation"] = busy
    return Outcome(pr.attainment, pressure(pr.result, len(st.workload.requests), st.sla, busy), summary)


def utilisation(result: SimResult, fleet: Counts) -> dict[str, float]:
    t = result.sim_time_s or 1.0
    return {r: result.busy_s.get(r, 0.0) / (fleet.count(r) * t) for r in fleet.shape.roles}


def pressure(result: SimResult, offered: int, sla: Sla, busy: dict[str, float]) -> dict[str, float]:
    """Per role, the share of offered requests whose miss points at it: a late first token at P,
    a slow or stalled decode at RLD (relayed requests) or MD/D (the others), an unfinished
    request at the busiest role."""
    out = dict.fromkeys(planner.ROLES, 0.0)
    for r in result.records:
        if r.ttft_s > sla.ttft_s:
            out["prefill"] += 1
        if not sla.met_by(dataclasses.replace(r, ttft_s=0.0)):
            out["decode" if r.pipeline == "p-md" else "relay"] += 1
    out[max(busy, key=busy.__getitem__)] += offered - len(result.records)
    return {k: v / offered for k, v in out.items()} if offered else out


def floors(st: Setting, profiles: set[str]) -> dict[str, tuple[int, int, int]]:
    """Per profile: (prefill floor, decode start, decode floor) for this workload and SLA. The
    decode start batches as many sequences as KV room and TPOT allow, each holding its whole
    context (shared prefixes make it high); the floor batches max_num_seqs with no KV read."""
    w, reqs = st.workload, st.workload.requests
    duration = w.duration_s or 1.0
    prompts = [(int(h * r.input_tokens), r.input_tokens) for h, r in zip(prefix_hits(w), reqs, strict=True)]
    n = max(len(reqs), 1)
    context = sum(r.input_tokens + r.output_tokens / 2 for r in reqs) / n
    out_rate = sum(r.output_tokens for r in reqs) / duration
    out = {}
    for name in profiles:
        c = st.chips[name]
        batch = planner.decode_batch(
            c.step,
            context,
            c.kv_capacity_bytes // st.model.kv_bytes_per_token,
            st.sla.tpot_s,
            st.sim.max_num_seqs,
        )
        out[name] = (
            planner.prefill_floor(prompts, duration, c.step),
            planner.decode_floor(out_rate, c.step, batch, context),
            planner.decode_floor(out_rate, c.step, st.sim.max_num_seqs, 0.0),
        )
    return out


Starts = tuple[list[Counts], dict[Shape, Counts]]  # where each shape's search starts, and its floor


def starts(dc_a: list[str], dc_b: list[str], fl: dict[str, tuple[int, int, int]]) -> tuple[Starts, Starts]:
    """Every PDD shape's start and floor, and every same-DC shape's (either DC)."""
    cross = [Shape(p, d, r) for p in dc_a for r in dc_a for d in dc_b]
    same = [
        Shape(p, d, None, dc) for dc, names in (("dc-a", dc_a), ("dc-b", dc_b)) for p in names for d in names
    ]

    def fleets(shapes: list[Shape]) -> Starts:
        relay = [s.relay is not None for s in shapes]
        begin = [
            Counts(s, fl[s.prefill][0], fl[s.decode][1], planner.relay_floor(fl[s.decode][1]) if r else 0)
            for s, r in zip(shapes, relay, strict=True)
        ]
        floor = {
            s: Counts(s, fl[s.prefill][0], fl[s.decode][2], int(r))
            for s, r in zip(shapes, relay, strict=True)
        }
        return begin, floor

    return fleets(cross), fleets(same)


def plan_one(
    label: str, shapes: Starts, st: Setting, args: argparse.Namespace
) -> tuple[Counts | None, planner.Search]:
    with progress(f"plan {label}", total=args.max_evals) as advance:
        evals = planner.Evaluations(lambda f: evaluate(st, f), args.max_evals, lambda f, o: advance())
        search = planner.Search(evals, st.cost, st.sla.attainment, args.max_instances)
        found = planner.cheapest(shapes[0], search, shapes[1])
    return found, search


def distinct(names: list[str], chips: dict[str, Chip]) -> tuple[list[str], dict[str, str]]:
    """The names whose chips differ (the first of equal ones kept), and each left-out name's twin:
    two profiles with the same figures and price would only repeat each other's simulations."""
    kept: list[str] = []
    twins: dict[str, str] = {}
    for n in names:
        twin = next(
            (
                k
                for k in kept
                if dataclasses.replace(chips[k], name="") == dataclasses.replace(chips[n], name="")
            ),
            None,
        )
        if twin is None:
            kept.append(n)
        else:
            twins[n] = twin
    return kept, twins


def fleet_row(st: Setting, f: Counts | None, evals: planner.Evaluations) -> dict | None:
    if f is None:
        return None
    out = evals.seen[f]
    roles = {r: {"count": f.count(r), "profile": f.shape.profile(r)} for r in f.shape.roles}
    return {
        "dc": f.shape.dc,
        **roles,
        "cost_per_hour": st.cost(f),
        "attainment": out.attainment,
        **out.summary,
    }


def search_row(st: Setting, found: Counts | None, search: planner.Search) -> dict:
    shapes = [{**dataclasses.asdict(shape), "outcome": what} for shape, what in search.shapes.items()]
    return {
        "fleet": fleet_row(st, found, search.evaluations),
        "shapes": shapes,
        "evaluations": eval_rows(st, search.evaluations),
    }


def eval_rows(st: Setting, evals: planner.Evaluations) -> list[dict]:
    return [
        {
            "shape": dataclasses.asdict(f.shape),
            "counts": {r: f.count(r) for r in f.shape.roles},
            "cost_per_hour": st.cost(f),
            "attainment": o.attainment,
            "pressure": o.pressure,
        }
        for f, o in evals.seen.items()
    ]


def setting(args: argparse.Namespace, names: list[str]) -> Setting:
    model = model_spec(args.model)
    sla = Sla(args.sla_ttft, args.sla_tpot, args.sla_gap, args.sla_attainment)
    wan = LinkSpec(args.wan_gbps * 1e9 / 8, args.wan_ms / 1e3, args.wan_jitter_ms / 1e3, args.wan_price)
    return Setting(make_workload(args), model, sla, {n: chip(n, model) for n in names}, wan, args.drain)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    st = setting(args, sorted({*_names(args.dc_a), *_names(args.dc_b)}))
    (dc_a, twins_a), (dc_b, twins_b) = (
        distinct(_names(args.dc_a), st.chips),
        distinct(_names(args.dc_b), st.chips),
    )
    cross, same = starts(dc_a, dc_b, floors(st, {*dc_a, *dc_b}))
    pdd_row = search_row(st, *plan_one("pdd", cross, st, args))
    same_row = search_row(st, *plan_one("same-dc", same, st, args))
    result = {
        "args": vars(args),
        "model": args.model,
        "sla": st.sla.describe(),
        "workload": {
            "name": st.workload.name,
            "requests": len(st.workload.requests),
            "duration_s": st.workload.duration_s,
        },
        "prices_per_hour": {n: c.price_per_hour for n, c in st.chips.items()} | {"wan-line": args.wan_price},
        "twins": twins_a | twins_b,
        "pdd": pdd_row,
        "same_dc": same_row,
        "saving": saving(pdd_row["fleet"], same_row["fleet"]),
        "max_evals": args.max_evals,
        "max_instances": args.max_instances,
    }
    result["wall_s"] = time.perf_counter() - started
    save_report(result, args.out, table=print_plan)
    return 0 if pdd_row["fleet"] is not None else 1


def _names(csv: str) -> list[str]:
    return [n.strip() for n in csv.split(",") if n.strip()]


def saving(cross: dict | None, same: dict | None) -> dict | None:
    if cross is None or same is None:
        return None
    usd = same["cost_per_hour"] - cross["cost_per_hour"]
    return {"usd_per_hour": usd, "share": usd / same["cost_per_hour"]}


def print_plan(r: dict) -> None:
    w = r["workload"]
    print(f"workload: {w['name']}, {w['requests']} requests over {w['duration_s']:.0f} s; model {r['model']}")
    print(f"SLA: {r['sla']}")
    for name, twin in r["twins"].items():
        print(f"{name}: the same chip and price as {twin} for this model, searched as {twin}")
    cross, same = r["pdd"]["fleet"], r["same_dc"]["fleet"]
    same_head = f"same-DC PD ({same['dc']})" if same else "same-DC PD"
    print(f"\n{'':<18}{'PDD (P+RLD dc-a, MD dc-b)':<28}{same_head}")
    for i, (label, cell) in enumerate(_rows()):
        print(f"{label:<18}{_cell(cell, cross, i):<28}{_cell(cell, same, i)}")
    counts = [len(r[k]["evaluations"]) for k in ("pdd", "same_dc")]
    print(f"{'simulations':<18}{counts[0]:<28}{counts[1]}  (at most {r['max_evals']} each)")
    for kind, roles in (("pdd", "P / RLD / MD"), ("same_dc", "P / D")):
        print(f"\n{kind} profiles ({roles}):")
        for s in r[kind]["shapes"]:
            relay = f" / {s['relay']}" if s["relay"] else ""
            print(f"  {s['dc']:<10} {s['prefill']}{relay} / {s['decode']}: {s['outcome']}")
    s = r["saving"]
    if s:
        more_less = "less" if s["usd_per_hour"] >= 0 else "more"
        print(
            f"\nPDD costs ${abs(s['usd_per_hour']):.2f}/h ({abs(s['share']):.1%}) {more_less} than same-DC PD"
        )


def _rows() -> list[tuple[str, Callable[[dict], str]]]:
    def role(name: str) -> Callable[[dict], str]:
        return lambda f: f"{f[name]['count']} x {f[name]['profile']}" if name in f else "-"

    def pair(key: str, scale: float, unit: str) -> Callable[[dict], str]:
        return lambda f: f"{f[key + '_p50_s'] * scale:.0f} / {f[key + '_p99_s'] * scale:.0f} {unit}"

    return [
        ("P", role("prefill")),
        ("RLD", role("relay")),
        ("MD / D", role("decode")),
        ("cost", lambda f: f"${f['cost_per_hour']:.2f}/h"),
        ("SLA attained", lambda f: f"{f['attainment']:.1%}"),
        ("TTFT p50/p99", pair("ttft", 1e3, "ms")),
        ("TPOT p50/p99", pair("tpot", 1e3, "ms")),
        ("max gap p50/p99", pair("max_gap", 1e3, "ms")),
        ("WAN mean/p99", lambda f: f"{f['wan_gbps_mean']:.1f} / {f['wan_gbps_p99']:.1f} Gb/s"),
    ]


def _cell(cell: Callable[[dict], str], fleet: dict | None, row: int) -> str:
    return cell(fleet) if fleet else "none met the SLA" if row == 0 else ""
