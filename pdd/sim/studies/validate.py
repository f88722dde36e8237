"""`pdd sim validate`: the `pdd bench e2e` scenarios in the simulator, beside the measured runs.

Reads bench/out/e2e_agentic.json and e2e_single.json (`--run` makes them first), rebuilds each
scenario's deployments and workload from the run's recorded config (agentic: the bench's agents
in its waves), simulates them with the `cpu-calibrated` profile (each engine with the KV pool
the bench gave it) and prints, per
deployment, the medians (and p99s) of TTFT, 2nd token, max gap and TPOT: simulated, measured,
error, within ±25%; and per metric whether the deployments come in the same order.

The host: the bench runs the engines of one deployment at a time on a shared 2-core machine,
one torch thread each, while cpu-calibrated times one engine alone on a core. Each deployment's
steps are made what they are on its share of the host (`--cpu-share`). By default (measured)
from the CPU seconds the bench recorded per deployment (pdd/sim/studies/host_cpu.py): the
non-engine work (router, NATS, WAN emulator, the client, other tenants) takes its measured cores
first, and the engines share the rest: a busy engine's step is as fast as the cores it gets,
(cores - background) / engines a step sees busy: under one, one thread's step that much slower;
past one, that far towards the profile's helped step (pdd up's low-priority kernel helper on a
second core); "engines a step sees busy" from the engines' busy spells in a first simulation at
full speed. Each role's steps are followed by the time its engine loop spent between steps in
the run (the services' pdd_engine_between_steps_seconds, as the bench recorded it). All of a
system's engines share this host, so its decoders give way to prefill's backlog
(SimSettings.give_way). For a run that did not record CPU seconds: `auto`, max(1, the host's
load average at the run's end / cores); with neither, or with `engines`, max(1, engines busy at
once in the simulation / cores) (a lower bound).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pdd.benchkit.cpu import service_of
from pdd.sim.fleet.deployment import IN_DC, Deployment, LinkSpec, RoleSpec, naive, pdd, same_dc
from pdd.sim.fleet.give_way import GiveWayRule
from pdd.sim.fleet.records import RequestRecord, SimResult, percentile
from pdd.sim.fleet.simulator import SimSettings, simulate
from pdd.sim.hardware.chip import Chip
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.hardware.profiles import chip, helped_step, model_spec
from pdd.sim.hardware.step_cost import StepCost
from pdd.sim.studies.host_cpu import HostCpu, engines_seen_busy, from_account, scaled
from pdd.sim.workloads.agentic import AgenticParams, agentic_closed_loop, closed_loop_shared_prefix
from pdd.sim.workloads.workload import SimRequest, Workload
from shared.config import PrefillSettings, RelaySettings, RouterSettings

TOLERANCE = 0.25  # a simulated median within ±25% of the measured one
METRICS = {"ttft": "TTFT", "tt2t": "2nd token", "max_gap": "max gap", "tpot": "TPOT"}
BLOCK = 16  # the engine's block size (EngineSettings.block_size)
MODEL = "small"  # the preset `pdd bench e2e` serves, in fp32
# KV pools as bench/e2e.py sets them (service_env): single gives every engine 256 MiB;
# agentic gives P and MD --md-kv-mb and the relay 256 MiB.
SINGLE_KV_MB = 256.0
RELAY_KV_MB = 256.0
ENGINE_MAX_BATCHED = 2048  # EngineSettings.max_batched_tokens
PREFILL_CHUNK = PrefillSettings.model_fields["prefill_chunk"].default  # P's, when the bench leaves it
ENGINE_MAX_SEQS = 64  # EngineSettings.max_num_seqs
# The bench warms MD with the shared system prompt (+64 tokens) before the traffic; the sim
# runs that request first and starts the agents this much later (simulated seconds).
WARM_S = 60.0
WARM_OUTPUT = 256  # long enough that PDD's relay hands it to MD (the bench forces P→MD)


@dataclass(frozen=True)
class Case:
    """One deployment of a scenario, as the simulator runs it."""

    deployment: Deployment
    workload: Workload
    settings: SimSettings
    warm: int = 0  # leading requests that only warm the caches (not measured)


# ---- rebuilding a scenario from the bench's recorded config ----------------------------------
def wan_link(config: dict) -> LinkSpec:
    """The emulated WAN: its jitter is uniform ±jitter_ms around delay_ms; the sim's adds
    uniform(0, jitter_s), so the same mean and spread start jitter_ms earlier."""
    jitter = config["jitter_ms"] / 1000
    bandwidth = config["bandwidth_mbps"] * 1e6 / 8 or math.inf  # 0: the emulator's uncapped link
    return LinkSpec(bandwidth, config["delay_ms"] / 1000 - jitter, 2 * jitter)


def engine(base: Chip, kv_mb: float) -> RoleSpec:
    """One engine with the KV pool the bench gave it (kv_memory_mb, in MiB)."""
    return RoleSpec(1, replace(base, kv_capacity_bytes=int(kv_mb * 2**20)))


def sim_settings(
    config: dict, router: RouterSettings | None = None, relay: RelaySettings | None = None
) -> SimSettings:
    """The engines' batching: every engine's step budget, and P's tokens of one prompt per step
    (--prefill-chunk: KV streams as it is computed)."""
    return SimSettings(
        router=router or RouterSettings(),
        relay=relay or RelaySettings(),
        max_batched_tokens=ENGINE_MAX_BATCHED,
        prefill_chunk=config.get("prefill_chunk") or PREFILL_CHUNK,
        max_num_seqs=ENGINE_MAX_SEQS,
        seed=config.get("seed", 0),
        first_token_at_prefill=True,  # pdd's prefill service sends its token to the router at once
        # One `pdd up` on this host: its decoders give way to prefill's backlog (with the kernels'
        # helper threads, which `pdd up` gives engines held to one thread on a shared host).
        give_way=GiveWayRule(),
    )


def agentic_cases(config: dict, base: Chip) -> dict[str, Case]:
    """same-dc (P→MD, no WAN), naive (P→MD over the WAN) and pdd (the router's policy), each
    serving the bench's closed-loop plan after the warm-up request."""
    p, md, rld = engine(base, config["md_kv_mb"]), engine(base, config["md_kv_mb"]), engine(base, RELAY_KV_MB)
    wan = wan_link(config)
    make = {
        "same-dc": lambda: same_dc(p, md),
        "naive": lambda: naive(p, md, wan),
        "pdd": lambda: pdd(p, rld, md, wan),
    }
    workload = warmed(
        agentic_closed_loop(AgenticParams.from_args(argparse.Namespace(**config)), BLOCK), config
    )
    settings = sim_settings(config)
    return {d: Case(make[d](), workload, settings, warm=1) for d in config["deployments"].split(",")}


def warmed(w: Workload, config: dict) -> Workload:
    """The bench's warm-up first (the shared system prompt + 64 tokens, its own client), then
    every agent's first request WARM_S later; the agents in the bench's waves (each agent's
    k-th request in wave k // --wave: a wave starts when every agent ended the last one)."""
    shared = closed_loop_shared_prefix(AgenticParams.from_args(argparse.Namespace(**config)), BLOCK)
    n = (config["shared_prefix"] + 64) // BLOCK * BLOCK
    warm = SimRequest(
        len(w.requests),
        0.0,
        n,
        WARM_OUTPUT,
        shared + tuple(random.Random("warm").getrandbits(63) for _ in range(n // BLOCK - len(shared))),
        client=-1,
        kind="warm",
    )
    done: dict[int | None, int] = {}  # requests listed so far per agent
    requests = []
    for r in w.requests:
        k = done.get(r.client, 0)
        done[r.client] = k + 1
        requests.append(replace(r, arrival_s=r.arrival_s + (0 if k else WARM_S), wave=k // config["wave"]))
    return replace(w, requests=(warm, *requests))


SINGLE_VARIANTS = {  # the bench's variants: (deployment kind, relay's catchup_threshold override)
    "no-wan": ("same-dc", None),
    "p-md": ("naive", None),
    "p-rld-md": ("pdd", None),
    "p-rld-md/one-shot": ("pdd", 100_000),
    "p-rld-md/catch-up-16": ("pdd", 16),
}


def single_cases(config: dict, base: Chip) -> dict[str, Case]:
    """Each variant alone: `rounds` uncached prompts one after another. P→RLD→MD is forced as
    the bench forces it: any WAN time sends the request through the relay."""
    p, d = engine(base, SINGLE_KV_MB), engine(base, SINGLE_KV_MB)
    wan = wan_link(config)
    workload = single_workload(config)
    out = {}
    for v in config["variants"].split(","):
        kind, threshold = SINGLE_VARIANTS[v]
        dep = {
            "same-dc": lambda: same_dc(p, d),
            "naive": lambda: naive(p, d, wan),
            "pdd": lambda: pdd(p, engine(base, SINGLE_KV_MB), d, wan),
        }[kind]()
        relay = RelaySettings(catchup_threshold=threshold) if threshold is not None else None
        router = RouterSettings(wan_time_threshold_s=0.0) if kind == "pdd" else None
        out[v] = Case(replace(dep, name=v), workload, sim_settings(config, router, relay))
    return out


def single_workload(config: dict) -> Workload:
    """`rounds` prompts of prompt_tokens fresh tokens, output_tokens each, 1 s apart (the bench
    lets the system settle a second between requests)."""
    rng = random.Random(f"single-{config['seed']}")
    n = config["prompt_tokens"]
    reqs = tuple(
        SimRequest(
            r,
            1.0 if r else 0.0,
            n,
            config["output_tokens"],
            tuple(rng.getrandbits(63) for _ in range(n // BLOCK)),
            client=0,
            kind="single",
        )
        for r in range(config["rounds"])
    )
    return Workload(f"single-{n}x{config['output_tokens']}", BLOCK, reqs, closed_loop=True)


SCENARIOS: dict[str, Callable[[dict, Chip], dict[str, Case]]] = {
    "agentic": agentic_cases,
    "single": single_cases,
}
SIDE = {"agentic": "deployment", "single": "variant"}  # the measured rows' key naming the deployment


# ---- the host: a CPU-share factor on step times ------------------------------------------------
def on_host(d: Deployment, step_of: Callable[[StepCost], StepCost]) -> Deployment:
    """Every engine's steps as `step_of` makes them of its one-thread steps."""

    def role(r: RoleSpec | None) -> RoleSpec | None:
        return r and replace(r, chip=replace(r.chip, step=step_of(r.chip.step)))

    return replace(d, prefill=role(d.prefill), decode=role(d.decode), relay=role(d.relay))


def with_share(d: Deployment, factor: float) -> Deployment:
    """Every engine's steps `factor` times as long (engines sharing too few cores)."""
    return on_host(d, lambda step: scaled(step, factor))


# The bench's engine services by the deployment's role they play (pdd/benchkit/cpu.py names).
ROLE_OF_SERVICE = {"prefill": "prefill", "main_decode": "decode", "relay": "relay"}


def loop_gaps(account: dict) -> dict[str, float]:
    """Per role, the mean seconds its busy engines spent between steps (the serving loop's output
    handling, commands and thread hops) over a deployment's timed runs; none where the run did
    not record them."""
    sums: dict[str, list[float]] = {}
    for name, loop in account.get("engine_figures", {}).items():
        role = ROLE_OF_SERVICE.get(service_of(name))
        if role:
            total = sums.setdefault(role, [0.0, 0.0])
            total[0], total[1] = total[0] + loop["between_s"], total[1] + loop["gaps"]
    return {role: s / n for role, (s, n) in sums.items() if n > 0}


def with_gaps(d: Deployment, gaps: dict[str, float]) -> Deployment:
    """Each role's steps followed by its measured time between steps."""

    def role(name: str) -> RoleSpec | None:
        r = getattr(d, name)
        if r is None or name not in gaps:
            return r
        step = r.chip.step
        return replace(r, chip=replace(r.chip, step=replace(step, overhead_s=step.overhead_s + gaps[name])))

    return replace(d, prefill=role("prefill"), decode=role("decode"), relay=role("relay"))


KV_PATHS = ("wan", "local")  # prefill's KV paths: to MD (through the WAN emulator), to the relay


def kv_path_rates(account: dict) -> dict[str, float]:
    """Per KV path, the rate (bytes/s) at which a prompt's last KV blocks reached their peer in
    the run: their KV bytes over the seconds from handing them to the sender to the ack
    (pdd_kv_tail_seconds); none where the run did not record it."""
    sums: dict[str, tuple[float, float]] = {}
    for figures in account.get("engine_figures", {}).values():
        for path in KV_PATHS:
            if figures.get(f"tails_{path}"):
                b, t = sums.get(path, (0.0, 0.0))
                sums[path] = (b + figures[f"tail_bytes_{path}"], t + figures[f"tail_s_{path}"])
    return {path: b / t for path, (b, t) in sums.items() if t > 0}


def on_kv_paths(d: Deployment, rates: dict[str, float]) -> Deployment:
    """The host's unshaped KV paths at their measured rates, where the simulator's in-DC path
    (400 Gbit/s, RDMA-class) stood: P→D in one DC (the bench runs it through the WAN emulator,
    delay and cap lifted: TLS at both ends, the emulator's copy between) and P→RLD (the local
    path). A shaped WAN stays the emulator's settings."""
    if d.kind == "same-dc" and "wan" in rates:
        d = replace(d, wan=LinkSpec(rates["wan"], IN_DC.one_way_s))
    if d.relay is not None and "local" in rates:
        d = replace(d, local=LinkSpec(rates["local"], IN_DC.one_way_s))
    return d


def share_factor(engines: float, cores: float) -> float:
    return max(1.0, engines / cores)


LOAD_WINDOWS_S = (60, 300, 900)  # the kernel's 1, 5 and 15 minute load averages


def host_share(report: dict) -> float | None:
    """Processor sharing on the measured host: its load average at the run's end over its cores,
    the average whose window is nearest the run's wall time. None: the run did not record it."""
    host = report.get("host")
    if not host:
        return None
    i = min(range(3), key=lambda k: abs(LOAD_WINDOWS_S[k] - report["wall_s"]))
    return share_factor(host["loadavg_end"][i], host["cores"])


def resolve_share(knob: str, report: dict) -> float | None:
    """--cpu-share: a factor, or None for each case's own engine concurrency (engines,
    measured)."""
    if knob in ("engines", "measured"):
        return None
    if knob == "auto":
        return host_share(report)
    return float(knob)


def measured_hosts(
    knob: str, report: dict, cores: float, helped: StepCost | None = None
) -> dict[str, HostCpu]:
    """--cpu-share measured: each deployment's (variant's) host CPU from the run's CPU accounts;
    none where the run did not record them (then auto's load average, else engines)."""
    if knob != "measured" or "cpu" not in report:
        return {}
    cores = report["cpu"].get("cores", cores)
    return {d: from_account(a, cores, helped) for d, a in report["cpu"]["accounts"].items()}


def measured_spells(result: SimResult, warm: int) -> tuple[list[list[tuple[float, float]]], float]:
    """Each engine's busy spells over the measured part of a run (from the first request after
    the warm-up on; all of it if none), and that part's span."""
    start = min((r.arrival_s for r in result.records if r.kind != "warm"), default=0.0) if warm else 0.0
    spells = [[(max(a, start), b) for a, b in s if b > start] for s in result.busy_spells.values()]
    return spells, result.sim_time_s - start


def full_speed_engines(case: Case, model: ModelSpec) -> tuple[float, float]:
    """From a run at full speed, over its measured part: the engines computing at once on
    average (their busy seconds over the span) and as a step sees them (engines_seen_busy)."""
    result = simulate(case.deployment, case.workload, model, replace(case.settings, busy_spells=True))
    spells, span = measured_spells(result, case.warm)
    busy = sum(b - a for s in spells for a, b in s)
    return (busy / span if span > 0 else 0.0), engines_seen_busy(spells)


@dataclass(frozen=True)
class Hosting:
    """How a case's engines ran on the measured host: its steps' slowdown factor, the share of a
    second core their helpers had, and the engines a step saw busy (NaN for a given factor)."""

    factor: float
    helper_core: float = 0.0
    engines: float = math.nan


def run_case(
    case: Case,
    model: ModelSpec,
    share: float | None,
    cores: float,
    host: HostCpu | None = None,
    gaps: dict[str, float] | None = None,
) -> tuple[SimResult, Hosting]:
    """Simulate a case at a CPU share (None: from its engines' concurrency in a first run at full
    speed: as a step sees it on the measured host's engine cores if `host`, else the mean on all
    `cores`), each role's steps followed by its measured time between steps (`gaps`: wall time
    in the run, added after the host's share)."""
    if share is not None:
        hosting, deployment = Hosting(share), with_share(case.deployment, share)
    elif host is None:
        mean, _ = full_speed_engines(case, model)
        hosting = Hosting(share_factor(mean, cores), engines=mean)
        deployment = with_share(case.deployment, hosting.factor)
    else:
        _, seen = full_speed_engines(case, model)
        hosting = Hosting(max(1.0, 1.0 / host.cores_each(seen)), host.helper_core(seen), seen)
        deployment = on_host(case.deployment, lambda step: host.step(step, seen))
    return simulate(with_gaps(deployment, gaps or {}), case.workload, model, case.settings), hosting


# ---- side by side ------------------------------------------------------------------------------
def stats(rows: list[dict]) -> dict[str, float]:
    """p50 and p99 of each metric over rows {metric: seconds} (NaN left out)."""
    return {
        f"{m}_p{q}": percentile([r[m] for r in rows if r[m] is not None], q)
        for m in METRICS
        for q in (50, 99)
    }


def simulated_stats(records: list[RequestRecord]) -> dict[str, float]:
    return stats([{m: getattr(r, f"{m}_s") for m in METRICS} for r in records if r.kind != "warm"])


def measured_stats(report: dict) -> dict[str, dict[str, float]]:
    """Per deployment (variant), from the run's successful rows."""
    side = SIDE[report["scenario"]]
    names = list(dict.fromkeys(r[side] for r in report["rows"]))
    return {d: stats([r for r in report["rows"] if r[side] == d and r["ok"]]) for d in names}


@dataclass(frozen=True)
class Row:
    scenario: str
    deployment: str
    metric: str  # e.g. "ttft_p50"
    simulated: float
    measured: float

    @property
    def error(self) -> float:
        return self.simulated / self.measured - 1 if self.measured else math.nan

    @property
    def within(self) -> bool | None:
        """Judged on medians only (a p99 is for information)."""
        return abs(self.error) <= TOLERANCE if self.metric.endswith("_p50") else None


def compare(
    scenario: str, simulated: dict[str, dict[str, float]], measured: dict[str, dict[str, float]]
) -> list[Row]:
    deps = [d for d in measured if d in simulated]
    return [
        Row(scenario, d, f"{m}_p{q}", simulated[d][f"{m}_p{q}"], measured[d][f"{m}_p{q}"])
        for d in deps
        for m in METRICS
        for q in (50, 99)
    ]


TIE = 0.05  # two medians this close (relative) are a tie: no ordering to agree or disagree with


def order(values: dict[str, float]) -> str:
    """Deployments from the lowest value to the highest, "a < b ≈ c" (≈: a tie with the previous)."""
    names = sorted(values, key=lambda d: values[d])
    out = names[:1]
    for a, b in zip(names, names[1:], strict=False):
        out += [" ≈ " if _sign(values[a], values[b]) == 0 else " < ", b]
    return "".join(out)


def _sign(a: float, b: float) -> int:
    """-1, 0 (a tie) or 1: how a compares with b."""
    if abs(a - b) <= TIE * max(abs(a), abs(b)):
        return 0
    return -1 if a < b else 1


def same_order(simulated: dict[str, float], measured: dict[str, float]) -> bool:
    """No pair of deployments that one side puts one way round and the other the other way
    (a tie on either side agrees with anything)."""
    names = list(measured)
    return all(
        _sign(simulated[a], simulated[b]) * _sign(measured[a], measured[b]) >= 0
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    )


def orderings(rows: list[Row]) -> dict[str, tuple[str, str, bool]]:
    """Per median metric: (simulated order, measured order, the same up to ties?)."""
    out = {}
    for m in METRICS:
        mine = [r for r in rows if r.metric == f"{m}_p50"]
        sim, meas = {r.deployment: r.simulated for r in mine}, {r.deployment: r.measured for r in mine}
        out[f"{m}_p50"] = (order(sim), order(meas), same_order(sim, meas))
    return out


# ---- printing, the command -----------------------------------------------------------------------
def _cell(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f} ms"


def print_table(rows: list[Row], hostings: dict[str, Hosting]) -> None:
    print(
        f"{'scenario':9s} {'deployment':32s} {'metric':14s} {'simulated':>10s} {'measured':>10s} "
        f"{'error':>7s}  ±25%"
    )
    for r in rows:
        judged = {True: "yes", False: "NO", None: "(info)"}[r.within]
        h = hostings[r.deployment]
        helper = f" +{h.helper_core:.2f}h" if h.helper_core else ""
        name = f"{r.deployment} (x{h.factor:.2f}{helper})" if r.metric == "ttft_p50" else ""
        label = f"{METRICS[r.metric[:-4]]} {r.metric[-3:]}"
        print(
            f"{r.scenario:9s} {name:32s} {label:14s} {_cell(r.simulated):>10s} {_cell(r.measured):>10s} "
            f"{r.error:+7.0%}  {judged}"
        )


def print_orderings(scenario: str, orders: dict[str, tuple[str, str, bool]]) -> None:
    for metric, (sim, meas, same) in orders.items():
        print(
            f"  {scenario} {METRICS[metric[:-4]]:9s} order simulated {sim}; measured {meas}: "
            f"{'same' if same else 'DIFFERENT'} (ties within {TIE:.0%})"
        )


def validate_scenario(
    report: dict, model: ModelSpec, base: Chip, knob: str, cores: float, helped: StepCost | None = None
) -> dict:
    """Simulate the scenario of one bench report; its rows, orderings, how each deployment's
    engines ran on the host and (measured) the host CPU and loop gaps that came from."""
    scenario = report["scenario"]
    if knob == "measured" and "cpu" not in report:
        knob = "auto"  # a run from before the bench recorded CPU seconds
    share, cores = resolve_share(knob, report), report.get("host", {}).get("cores", cores)
    hosts = measured_hosts(knob, report, cores, helped)
    accounts = report.get("cpu", {}).get("accounts", {})
    gaps = {d: loop_gaps(a) for d, a in accounts.items()}
    paths = {d: kv_path_rates(a) for d, a in accounts.items()}
    cases = SCENARIOS[scenario](report["config"], base)
    simulated, hostings = {}, {}
    for d, case in cases.items():
        case = replace(case, deployment=on_kv_paths(case.deployment, paths.get(d, {})))
        result, hostings[d] = run_case(case, model, share, cores, hosts.get(d), gaps.get(d))
        simulated[d] = simulated_stats(result.records)
    rows = compare(scenario, simulated, measured_stats(report))
    inputs = {
        d: host_inputs(accounts[d], hosts[d], hostings[d], gaps[d], paths[d]) for d in cases if d in hosts
    }
    return {"rows": rows, "orderings": orderings(rows), "hostings": hostings, "host_cpu": inputs}


def host_inputs(
    account: dict, host: HostCpu, hosting: Hosting, gaps: dict[str, float], paths: dict[str, float]
) -> dict[str, float]:
    """What a measured hosting came from, in cores (CPU seconds per wall second of the run),
    each role's measured seconds between steps and each KV path's measured rate (bytes/s)."""
    per = {n: s / account["wall_s"] for n, s in account["processes"].items()}
    nats = sum(c for n, c in per.items() if n.startswith("nats"))
    return {
        "cores": host.cores,
        "router": sum(c for n, c in per.items() if n.startswith("router")),
        "nats": nats,
        "wan": per.get("wan", 0.0),
        "up": per.get("up", 0.0),
        "client": account["bench_s"] / account["wall_s"],
        "idle_systems": account["other_systems_s"] / account["wall_s"],
        "other_tenants": account["other_tenants_s"] / account["wall_s"],
        "background": host.background_cores,
        "engine_cores": host.engine_cores,
        "engines_measured": account["engines_s"] / account["wall_s"],
        "engines_seen_busy": hosting.engines,
        "helper_core": hosting.helper_core,
        "factor": hosting.factor,
        **{f"between_steps_{role}_s": g for role, g in gaps.items()},
        **{f"kv_{path}_Bps": r for path, r in paths.items()},
    }


def print_host_cpu(scenario: str, inputs: dict[str, dict[str, float]]) -> None:
    """The measured CPU model's inputs, per deployment, in cores; the loop gaps in ms."""
    if not inputs:
        return
    print(
        f"  {scenario} host CPU (cores, measured): background = router + nats + wan + up + client + idle systems "
        f"+ other tenants; engines get cores - background, shared by the engines a step sees busy: past one core "
        f"each, their helpers get the rest of a second (+h, the step that far from one thread's to the helped "
        f"time); under one, x = 1 / cores; between steps (ms): each role's measured loop gap, added to its steps; "
        f"KV tails: each path's rate for a prompt's last blocks (used for the unshaped paths)"
    )
    for d, x in inputs.items():
        gaps = ", ".join(
            f"{k.removeprefix('between_steps_').removesuffix('_s')} {v * 1e3:.2f}"
            for k, v in x.items()
            if k.startswith("between_steps_")
        )
        paths = ", ".join(f"{k[3:-4]} {v / 1e9:.2f} GB/s" for k, v in x.items() if k.startswith("kv_"))
        print(
            f"    {d:20s} background {x['background']:.2f} = {x['router']:.2f} + {x['nats']:.2f} + {x['wan']:.2f} + "
            f"{x['up']:.2f} + {x['client']:.2f} + {x['idle_systems']:.2f} + {x['other_tenants']:.2f}; "
            f"engines get {x['engine_cores']:.2f} of {x['cores']:g} (used {x['engines_measured']:.2f}); "
            f"a step sees {x['engines_seen_busy']:.2f} busy: x{x['factor']:.2f} +{x['helper_core']:.2f}h; "
            f"between steps {gaps or '-'}; KV tails {paths or '-'}"
        )


def run_bench(scenario: str, path: Path, quick: bool) -> None:
    """The measured side: `python -m bench.e2e` with its defaults (the deadline: an hour)."""
    cmd = [sys.executable, "-m", "bench.e2e", "--scenario", scenario, "--out", str(path), "--quiet"]
    subprocess.run(cmd + (["--quick"] if quick else []), check=True, timeout=3600)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdd sim validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", type=Path, default=Path("bench/out"), help="where e2e_<scenario>.json are")
    p.add_argument("--run", action="store_true", help="run `pdd bench e2e` for each scenario first")
    p.add_argument("--quick", action="store_true", help="with --run: the bench's --quick")
    p.add_argument("--scenario", choices=["agentic", "single", "both"], default="both")
    p.add_argument("--profile", default="cpu-calibrated")
    p.add_argument(
        "--cpu-share",
        default="measured",
        help="step-time factor of the measured host's CPU sharing: a number; engines: max(1, engines "
        "busy at once in the simulation / cores); auto: max(1, the host's load average recorded "
        "by the bench / its cores), else as engines; measured: the cores each busy engine gets of "
        "what the non-engine CPU the bench measured per deployment leaves (under one: steps that "
        "much slower; over one: that far towards the profile's helped steps), else as auto",
    )
    p.add_argument(
        "--cores",
        type=float,
        default=os.cpu_count() or 1,
        help="the measured host's cores, where its run does not say",
    )
    p.add_argument("--out", type=Path, default=Path("bench/out/sim_validate.json"))
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    model = model_spec(MODEL)
    base = chip(args.profile, model)
    helped = helped_step(args.profile)
    results = {}
    for scenario in ("agentic", "single") if args.scenario == "both" else (args.scenario,):
        path = args.measured / f"e2e_{scenario}.json"
        if args.run:
            run_bench(scenario, path, args.quick)
        if not path.exists():
            print(f"no measured run at {path} (run `pdd bench e2e --scenario {scenario}` or pass --run)")
            return 2
        results[scenario] = validate_scenario(
            json.loads(path.read_text()), model, base, args.cpu_share, args.cores, helped
        )
    rows = [r for res in results.values() for r in res["rows"]]
    print_table(rows, {d: h for res in results.values() for d, h in res["hostings"].items()})
    for scenario, res in results.items():
        print_orderings(scenario, res["orderings"])
        print_host_cpu(scenario, res["host_cpu"])
    judged = [r for r in rows if r.within is not None]
    print(
        f"{sum(bool(r.within) for r in judged)} of {len(judged)} medians within ±{TOLERANCE:.0%}; orderings the "
        f"same for {sum(s for res in results.values() for *_, s in res['orderings'].values())} of "
        f"{sum(len(res['orderings']) for res in results.values())} (scenario, metric)"
    )
    save(args.out, results, args)
    return 0


def save(path: Path, results: dict, args: argparse.Namespace) -> None:
    out = {
        "profile": args.profile,
        "cpu_share": args.cpu_share,
        "cores": args.cores,
        "tolerance": TOLERANCE,
        "scenarios": {
            s: {
                "hostings": {d: vars(h) for d, h in res["hostings"].items()},
                "host_cpu": res["host_cpu"],
                "orderings": res["orderings"],
                "rows": [{**vars(r), "error": r.error, "within": r.within} for r in res["rows"]],
            }
            for s, res in results.items()
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=lambda x: None))
    print(f"wrote {path}")
