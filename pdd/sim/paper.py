"""`pdd sim paper`: the paper's fleet comparison, simulated, beside the paper's own figures.

The scenario (each choice is an assumption where the paper is silent; docs/simulator.md).
`--scenario` picks what is served; the default, 64k-hybrid, is the regime the paper describes
(64K-in / 1K-out agent traffic, a KV-light model, instances of several GPUs):
  64k-hybrid Qwen3-Next-80B-A3B in fp8 (79 GB of weights, 3.2B active: a large MoE) with
             hybrid attention: 12 of its 48 layers keep a per-token KV, 24 KiB a token in bf16
             (inside the paper's 10-80 KB; a "compressed-KV" model). 2 chips an instance: the
             weights do not fit one 80 GB gpu-a with room for KV; two leave 65 GB (gpu-a) and
             94 GB (gpu-b) of KV, ~40 and ~58 contexts of 64K.
  64k-moe    Qwen3-235B-A22B in fp8 with an fp8 KV cache (94 KiB a token: the KV-heavy end),
             4 chips an instance (235 GB of weights; 53 GB / 110 GB of KV per instance).
  7b-dense   Qwen2.5-7B in bf16 (56 KiB of KV per token), one GPU an instance, on the
             agentic PAPER traffic of 16-64K prompts (the scenario before the two above).
  chips      an instance spans `tp` chips (tensor parallel): tp x the chip's price, tp x its
             usable memory less the weights for KV, each chip computing and reading 1/tp of
             the step plus two all-reduces of the step's activations per layer over NVLink
             (pdd/sim/profiles.py roofline_step_cost). The fleets are the paper's in chips:
             88 A // tp instances, and 43 A // tp, 32 B // tp; a chip left over is priced.
  same-DC    88 x gpu-a, split into P and D the way an operator would: the split with the
             highest SLA goodput among a few (P = 37.5%, 50%, 62.5%, 75% of the fleet).
  PDD        43 x gpu-a for P + RLD, 32 x gpu-b for MD, one cross-DC line. The relay count is
             the one with the highest SLA goodput among ~5% and 10% of the 43 (fewer on a tie):
             the paper's relay is a small slice.
  naive      the same 43 A + 32 B and line with no relay: all 43 A prefill, always P->MD.
  line       --wan-gbps (400 Gb/s: one 400ZR-class wavelength), 20 ms RTT between cities,
             5 ms jitter per crossing, --line-price USD/h (1.00: what the paper's two cost
             figures imply, 0.32-0.35 gpu-a hours per hour; no public price is quoted).
  prices     gpu-a's profile price; gpu-b at 1.20x and 1.30x of it (the paper's 20-30% premium)
             for the cost and BCR changes (the paper's fleets' costs: BCR change = goodput
             ratio / cost ratio - 1), and at its profile's 1.25x in the fleet costs shown.
  workload   64k-*: agentic_open_loop(PAPER_64K): sessions on a 48K shared context, new tasks
             of 56-64K, turns growing to 72K, answers of 512-1536 tokens (1K mean), ~88% mean
             prefix hit, 3.5% outliers of 64K in / 256 out. 7b-dense: PAPER (16-64K prompts,
             128-1024 out).
  SLA        90% of requests with TPOT <= 100 ms and no gap between two tokens over 1 s (a WAN
             wait before MD's first token counts), and TTFT <= 8 s for 64K prompts (the paper
             measured a same-DC P50 of 4.2 s: an SLA 90% meet sits above the median), 4 s for
             7b-dense (its 64K outliers' prefill fits).
  sharing    a prompt block already on its way to an MD is not sent again (pdd/sim/fleet.py);
             --no-share-in-flight sends each request its MD's every missing block.
  router     the project's defaults, told the line's bandwidth and RTT.
Latencies (TTFT, gaps) and WAN bytes are compared at one offered rate, the same-DC fleet's SLA
goodput; PDD's WAN bytes also at its own goodput, where the line is not a queue. The WAN bytes
cut is reported as the line counted it and as the router believed it (the KV it counted as
missing at MD when it routed each request).
`--scale` shrinks every instance count, the rates and the line's bandwidth with it (tests,
--quick).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.sim import profiles
from pdd.sim.agentic import PAPER, PAPER_64K, AgenticParams, agentic_open_loop, hit_profile
from pdd.sim.chip import Chip
from pdd.sim.deployment import Deployment, LinkSpec, RoleSpec, naive, pdd, same_dc
from pdd.sim.goodput import Goodput, Probe, probe, sla_goodput
from pdd.sim.model_spec import ModelSpec
from pdd.sim.records import RequestRecord
from pdd.sim.simulator import SimSettings
from pdd.sim.sla import Sla
from pdd.sim.workload import Workload
from shared.config import RouterSettings

BLOCK_SIZE = 512
BASELINE_A, PDD_A, PDD_B = 88, 43, 32  # the paper's fleets, in chips
PREMIUMS = (1.20, 1.30)  # gpu-b's price over gpu-a's
SPLITS = (0.375, 0.5, 0.625, 0.75)  # same-DC: P's share of the fleet
RELAY_SHARES = (0.05, 0.1)  # PDD: RLD's share of the 43 gpu-a
# The paper's figures: PDD against the same-DC homogeneous PD baseline.
PAPER_FIGURES = {
    "ttft_p50_change": -0.515,
    "goodput_change": 0.278,
    "bcr_change": 0.375,  # "up to"
    "cost_change_20": -0.071,  # 3.5-7.1% cheaper at a 20-30% premium
    "cost_change_30": -0.035,
    "bandwidth_ratio": 10.0,  # "up to 10x" less cross-DC bandwidth at 90% hit
}


@dataclass(frozen=True)
class Regime:
    """What is served and on how many chips: one named scenario of `--scenario`."""

    model: str  # pdd/sim/models/<model>.json
    tp: int  # chips per instance, every role (tensor parallel)
    sla: Sla
    start_rps: float  # the goodput search's first rate at full scale
    quick_scale: float  # --quick's fleet scale (whole instances per role)
    traffic: AgenticParams = PAPER
    kv_layers: int | None = None  # the model with this many full-attention layers (pdd sim map)


def model_of(r: Regime) -> ModelSpec:
    spec = profiles.model_spec(r.model)
    return replace(spec, kv_layers=r.kv_layers) if r.kv_layers else spec


REGIMES = {
    "64k-moe": Regime(
        "qwen3-235b-a22b-fp8",
        4,
        Sla(ttft_s=8.0, tpot_s=0.1, max_gap_s=1.0, attainment=0.9),
        8.0,
        0.5,
        PAPER_64K,
    ),
    "64k-hybrid": Regime(
        "qwen3-next-80b-a3b-fp8",
        2,
        Sla(ttft_s=8.0, tpot_s=0.1, max_gap_s=1.0, attainment=0.9),
        64.0,
        0.5,
        PAPER_64K,
    ),
    "7b-dense": Regime(
        "qwen2.5-7b", 1, Sla(ttft_s=4.0, tpot_s=0.1, max_gap_s=1.0, attainment=0.9), 64.0, 0.1
    ),
}
DEFAULT_REGIME = "64k-hybrid"


@dataclass(frozen=True)
class Scenario:
    scale: float = 1.0
    duration_s: float = 20.0
    seed: int = 0
    wan_gbps: float = 400.0
    rtt_s: float = 0.02
    jitter_s: float = 0.005
    line_price: float = 1.0
    rel_tol: float = 0.1
    jobs: int = 2
    regime: str | Regime = DEFAULT_REGIME  # a name of REGIMES, or one made for the occasion
    share_in_flight: bool = True

    @property
    def r(self) -> Regime:
        return REGIMES[self.regime] if isinstance(self.regime, str) else self.regime

    def count(self, chips: int) -> int:
        """Instances of `chips` chips' worth of a fleet, at this scale."""
        return max(1, round(chips // self.r.tp * self.scale))

    @property
    def line(self) -> LinkSpec:
        """The cross-DC line; a scaled-down fleet gets a line scaled down with it."""
        return LinkSpec(self.wan_gbps * self.scale * 1e9 / 8, self.rtt_s / 2, self.jitter_s, self.line_price)

    @property
    def settings(self) -> SimSettings:
        router = RouterSettings(default_bandwidth_bps=self.line.bandwidth_Bps, default_rtt_s=self.rtt_s)
        return SimSettings(router=router, seed=self.seed, share_in_flight=self.share_in_flight)


# ---- the fleets and their prices -----------------------------------------------------------
def chips(sc: Scenario | None = None) -> tuple[Chip, Chip]:
    """gpu-a's and gpu-b's instances of the scenario's model (tp chips each)."""
    r = (sc or Scenario()).r
    model = model_of(r)
    return profiles.chip("gpu-a", model, r.tp), profiles.chip("gpu-b", model, r.tp)


def at_premium(a: Chip, b: Chip, premium: float) -> Chip:
    """gpu-b priced `premium` x gpu-a."""
    return replace(b, price_per_hour=a.price_per_hour * premium)


def same_dc_fleet(sc: Scenario, a: Chip, prefills: int) -> Deployment:
    total = sc.count(BASELINE_A)
    return same_dc(
        RoleSpec(prefills, a), RoleSpec(total - prefills, a), f"same-dc {prefills}P+{total - prefills}D"
    )


def pdd_fleet(sc: Scenario, a: Chip, b: Chip, relays: int) -> Deployment:
    p = sc.count(PDD_A) - relays
    return pdd(
        RoleSpec(p, a),
        RoleSpec(relays, a),
        RoleSpec(sc.count(PDD_B), b),
        sc.line,
        f"pdd {p}P+{relays}RLD+{sc.count(PDD_B)}MD",
    )


def naive_fleet(sc: Scenario, a: Chip, b: Chip) -> Deployment:
    p, md = sc.count(PDD_A), sc.count(PDD_B)
    return naive(RoleSpec(p, a), RoleSpec(md, b), sc.line, f"naive {p}P+{md}MD")


def candidates(sc: Scenario, a: Chip, b: Chip) -> list[Deployment]:
    """The same-DC splits, the PDD relay counts and the naive fleet, each to be searched."""
    total, pdd_a = sc.count(BASELINE_A), sc.count(PDD_A)
    splits = sorted({min(total - 1, max(1, round(total * f))) for f in SPLITS})
    relays = sorted({min(pdd_a - 1, max(1, round(pdd_a * f))) for f in RELAY_SHARES})
    return (
        [same_dc_fleet(sc, a, p) for p in splits]
        + [pdd_fleet(sc, a, b, r) for r in relays]
        + [naive_fleet(sc, a, b)]
    )


def cost_change(a: Chip, line_price: float, premium: float) -> float:
    """The paper's fleets' cost per hour (PDD's over same-DC's, minus one), with gpu-b at
    `premium` x gpu-a, in chips: 43 A + 32 B + the line over 88 A (chips an instance count
    leaves over are bought all the same)."""
    chip = a.price_per_hour / a.chips
    baseline = BASELINE_A * chip
    return (PDD_A * chip + PDD_B * chip * premium + line_price) / baseline - 1.0


def with_premium(d: Deployment, a: Chip, premium: float) -> Deployment:
    """The deployment with its gpu-b instances priced at `premium` x gpu-a."""
    if d.decode.chip.name != "gpu-b":
        return d
    return replace(d, decode=replace(d.decode, chip=at_premium(a, d.decode.chip, premium)))


# ---- bandwidth -------------------------------------------------------------------------------
def full_prompt_bytes(records: list[RequestRecord], kv_bytes_per_token: int) -> int:
    """What a transfer without MD's prefix cache would send: every prompt's whole KV."""
    return sum(r.input_tokens for r in records) * kv_bytes_per_token


def bandwidth_ratio(records: list[RequestRecord], kv_bytes_per_token: int) -> float:
    """Full-prompt KV over the KV the WAN carried, for the same requests."""
    sent = sum(r.wan_bytes for r in records)
    return full_prompt_bytes(records, kv_bytes_per_token) / sent if sent else float("inf")


def believed_ratio(records: list[RequestRecord], kv_bytes_per_token: int) -> float:
    """Full-prompt KV over the KV the router believed each request would put on the WAN (it
    counts a prompt's blocks as MD's once it sent the request there)."""
    believed = sum(r.believed_wan_bytes for r in records)
    return full_prompt_bytes(records, kv_bytes_per_token) / believed if believed else float("inf")


# ---- the searches ----------------------------------------------------------------------------
def make_workload(sc: Scenario, rate_rps: float) -> Workload:
    return agentic_open_loop(sc.r.traffic, rate_rps, sc.duration_s, BLOCK_SIZE, seed=sc.seed)


def search(sc: Scenario, d: Deployment) -> Goodput:
    """SLA goodput of one deployment (run in a worker process: results only, no callbacks)."""
    model = model_of(sc.r)
    return sla_goodput(
        d,
        partial(make_workload, sc),
        model,
        sc.r.sla,
        sc.settings,
        start_rps=sc.r.start_rps * sc.scale,
        rel_tol=sc.rel_tol,
        drain_s=60.0,
    )


def search_all(sc: Scenario, fleets: list[Deployment]) -> list[Goodput]:
    """Every fleet's goodput, `sc.jobs` at a time; the bar advances by each search's probes."""
    with progress("pdd sim paper: probes", total=None) as advance, ProcessPoolExecutor(sc.jobs) as pool:
        futures = [pool.submit(search, sc, d) for d in fleets]
        out = []
        for f in futures:
            out.append(f.result())
            advance(len(out[-1].probes))
    return out


def probe_at(sc: Scenario, d: Deployment, rate: float) -> Probe:
    model = model_of(sc.r)
    return probe(d, make_workload(sc, rate), model, sc.r.sla, rate, sc.settings, drain_s=60.0)


# ---- the comparison --------------------------------------------------------------------------
def best(fleets: list[Deployment], found: list[Goodput], kind: str) -> tuple[Deployment, Goodput]:
    """The highest goodput of a kind; on a tie the first listed (fewer P, fewer relays)."""
    pairs = [(d, g) for d, g in zip(fleets, found, strict=True) if d.kind == kind]
    return max(pairs, key=lambda dg: dg[1].rate_rps)  # max keeps the first of equals


def change(new: float, old: float) -> float:
    return new / old - 1.0 if old else float("nan")


def metrics(
    sc: Scenario, a: Chip, chosen: dict[str, tuple[Deployment, Goodput]], at: dict[str, Probe]
) -> dict:
    """Our figures for PDD against same-DC (and naive's goodput), as fractions."""
    kvbpt = model_of(sc.r).kv_bytes_per_token
    base_g, pdd_g = chosen["same-dc"][1], chosen["pdd"][1]
    s_base, s_pdd = at["same-dc"].result.summary(), at["pdd"].result.summary()
    records = at["pdd"].result.records
    m = {
        "ttft_p50_change": change(s_pdd["ttft_p50_s"], s_base["ttft_p50_s"]),
        "ttft_p99_change": change(s_pdd["ttft_p99_s"], s_base["ttft_p99_s"]),
        "goodput_change": change(pdd_g.rate_rps, base_g.rate_rps),
        "naive_goodput_change": change(chosen["naive"][1].rate_rps, base_g.rate_rps),
        "bandwidth_ratio": bandwidth_ratio(records, kvbpt),
        "believed_bandwidth_ratio": believed_ratio(records, kvbpt),
        "believed_ratio_unfiltered": believed_ratio([r for r in records if not r.filtered], kvbpt),
        "bandwidth_ratio_unfiltered": bandwidth_ratio([r for r in records if not r.filtered], kvbpt),
        "wan_waited_block_share": sum(r.wan_waited_blocks for r in records)
        / max(1, sum(r.input_tokens // BLOCK_SIZE for r in records)),
        "md_recomputed_tokens": sum(r.md_recomputed_tokens for r in records),
        "wan_gbps_mean": s_pdd["wan_gbps_mean"],
        "wan_gbps_p99": s_pdd["wan_gbps_p99"],
        "cacheless_gbps_mean": s_pdd["wan_gbps_mean"] * bandwidth_ratio(records, kvbpt),
        "workload_mean_hit": hit_profile(make_workload(sc, at["pdd"].rate_rps))["mean"],
        "md_hit_mean": sum(r.hit_rate for r in records) / max(1, len(records)),
        **own_rate_bandwidth(pdd_g, kvbpt),
        "rld_token_share": s_pdd["rld_token_share"],
        "pipelines": s_pdd["pipelines"],
        "filtered_share": s_pdd["filtered"] / max(1, len(records)),
    }
    for premium in (*PREMIUMS, 1.25):
        tag = f"{round(premium * 100) - 100}"
        m[f"cost_change_{tag}"] = cost_change(a, sc.line_price, premium)
        # (the paper's fleets' costs: the goodput ratio over their cost ratio, at any --scale)
        m[f"bcr_change_{tag}"] = (1.0 + m["goodput_change"]) / (1.0 + m[f"cost_change_{tag}"]) - 1.0
    return m


def own_rate_bandwidth(g: Goodput, kv_bytes_per_token: int) -> dict:
    """PDD's WAN at its own SLA goodput, where the line is not the queue it is at same-DC's rate."""
    p = g.at_goodput
    if p is None:
        return {}
    s = p.result.summary()
    return {
        "own_rate_rps": p.rate_rps,
        "own_rate_bandwidth_ratio": bandwidth_ratio(p.result.records, kv_bytes_per_token),
        "own_rate_wan_gbps_mean": s["wan_gbps_mean"],
        "own_rate_wan_gbps_p99": s["wan_gbps_p99"],
    }


def agrees(paper: float, ours: float) -> bool:
    """The same direction, and within half the paper's figure of it."""
    return paper * ours > 0 and abs(ours - paper) <= 0.5 * abs(paper)


def rows(m: dict) -> list[dict]:
    """metric | paper | ours | agrees? (fractions shown as percentages)."""
    pct, ratio = "{:+.1%}".format, "{:.1f}x".format
    spec = [  # label, the paper's figure, ours, format
        ("TTFT p50 change", "ttft_p50_change", "ttft_p50_change", pct),
        ("TTFT p99 change", None, "ttft_p99_change", pct),
        ("SLA goodput change", "goodput_change", "goodput_change", pct),
        ("BCR change, gpu-b at 1.20x", "bcr_change", "bcr_change_20", pct),
        ("BCR change, gpu-b at 1.30x", None, "bcr_change_30", pct),
        ("cost change, gpu-b at 1.20x", "cost_change_20", "cost_change_20", pct),
        ("cost change, gpu-b at 1.30x", "cost_change_30", "cost_change_30", pct),
        (
            f"WAN bytes cut at {m['workload_mean_hit']:.0%} mean hit",
            "bandwidth_ratio",
            "bandwidth_ratio",
            ratio,
        ),
        ("WAN bytes cut, the router's belief", "bandwidth_ratio", "believed_bandwidth_ratio", ratio),
        ("WAN bytes cut, at PDD's own goodput", "bandwidth_ratio", "own_rate_bandwidth_ratio", ratio),
    ]
    out = []
    for label, paper_key, ours_key, fmt in spec:
        paper, ours = PAPER_FIGURES.get(paper_key or ""), m.get(ours_key, float("nan"))
        verdict = "-" if paper is None else "yes" if agrees(paper, ours) else "no"
        out.append(
            {
                "metric": label,
                "paper": "-" if paper is None else fmt(paper),
                "ours": fmt(ours),
                "agrees": verdict,
            }
        )
    return out


def targets(m: dict) -> list[dict]:
    """The paper's figures as targets for ours (at least as good), and the router's belief
    of the WAN bytes cut within 10% of the line's."""
    pct, ratio = "{:+.1%}".format, "{:.1f}x".format
    belief = m["believed_bandwidth_ratio"] / m["bandwidth_ratio"] - 1.0
    return [
        {
            "what": "SLA goodput change >= +27.8%",
            "value": pct(m["goodput_change"]),
            "met": m["goodput_change"] >= 0.278,
        },
        {
            "what": "BCR change (gpu-b at 1.2x) >= +37.5%",
            "value": pct(m["bcr_change_20"]),
            "met": m["bcr_change_20"] >= 0.375,
        },
        {
            "what": "WAN bytes cut >= 8x",
            "value": ratio(m["bandwidth_ratio"]),
            "met": m["bandwidth_ratio"] >= 8.0,
        },
        {
            "what": "router's believed cut within 10% of the line's",
            "value": pct(belief),
            "met": abs(belief) <= 0.1,
        },
    ]


def print_table(result: dict) -> None:
    print(f"\n{result['scenario']['sla']}; compared at {result['at_rate_rps']:.1f} req/s")
    for name, f in result["fleets"].items():
        print(
            f"  {name:8s} {f['name']:26s} goodput {f['goodput_rps']:7.1f} req/s  ${f['cost_per_hour']:.2f}/h"
        )
    print(f"\n| {'metric':38s} | {'paper':>8s} | {'ours':>8s} | agrees? |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 10}|---------|")
    for r in result["rows"]:
        print(f"| {r['metric']:38s} | {r['paper']:>8s} | {r['ours']:>8s} | {r['agrees']:7s} |")
    m = result["metrics"]
    print(
        f"\nPDD's WAN: {m['wan_gbps_mean']:.1f} Gbit/s mean, {m['wan_gbps_p99']:.1f} p99 (cacheless: "
        f"{m['cacheless_gbps_mean']:.1f} mean); MD hit {m['md_hit_mean']:.1%}; RLD token share "
        f"{m['rld_token_share']:.1%} (paper 6.2%); pipelines "
        + ", ".join(f"{k} {v:.1%}" for k, v in m["pipelines"].items())
        + f"; filtered {m['filtered_share']:.1%}"
    )
    print(
        f"WAN bytes cut: the line {m['bandwidth_ratio']:.1f}x, the router's belief "
        f"{m['believed_bandwidth_ratio']:.1f}x (without the filtered requests: "
        f"{m['bandwidth_ratio_unfiltered']:.1f}x and {m['believed_ratio_unfiltered']:.1f}x); "
        f"{m['wan_waited_block_share']:.1%} of prompt blocks came in another request's transfer, "
        f"{m['md_recomputed_tokens']} tokens recomputed on MD"
    )
    if "own_rate_rps" in m:
        print(
            f"At PDD's own goodput ({m['own_rate_rps']:.1f} req/s) its WAN: {m['own_rate_wan_gbps_mean']:.1f} "
            f"Gbit/s mean, {m['own_rate_wan_gbps_p99']:.1f} p99"
        )


def figure(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    pct = [r for r in result["rows"] if r["ours"].endswith("%")]
    x = range(len(pct))
    value = lambda s: float(s.rstrip("%")) if s != "-" else 0.0  # noqa: E731
    ax.bar([i - 0.2 for i in x], [value(r["paper"]) for r in pct], 0.4, label="paper")
    ax.bar([i + 0.2 for i in x], [value(r["ours"]) for r in pct], 0.4, label="simulated")
    ax.set_xticks(list(x), [r["metric"] for r in pct], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("PDD vs same-DC (%)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend()
    return fig


# ---- the command -----------------------------------------------------------------------------
def run(sc: Scenario) -> dict:
    started = time.perf_counter()
    a, b = chips(sc)
    fleets = candidates(sc, a, b)
    found = search_all(sc, fleets)
    chosen = {kind: best(fleets, found, kind) for kind in ("same-dc", "naive", "pdd")}
    base_g = chosen["same-dc"][1]
    if base_g.at_goodput is None:
        raise SystemExit("pdd sim paper: the same-DC fleet met the SLA at no rate probed")
    rate = base_g.rate_rps
    with ProcessPoolExecutor(sc.jobs) as pool:  # the others at the same-DC fleet's goodput
        at = {k: pool.submit(probe_at, sc, chosen[k][0], rate) for k in ("naive", "pdd")}
        at = {"same-dc": base_g.at_goodput, **{k: f.result() for k, f in at.items()}}
    m = metrics(sc, a, chosen, at)
    return {
        "scenario": {
            **asdict(sc),
            "model": sc.r.model,
            "tp": sc.r.tp,
            "kv_bytes_per_token": model_of(sc.r).kv_bytes_per_token,
            "sla": sc.r.sla.describe(),
            "block_size": BLOCK_SIZE,
        },
        "fleets": {
            k: {"name": d.name, "goodput_rps": g.rate_rps, "cost_per_hour": d.cost_per_hour}
            for k, (d, g) in chosen.items()
        },
        "searched": [
            {
                "name": d.name,
                "goodput_rps": g.rate_rps,
                "probes": [{"rate_rps": p.rate_rps, "attainment": p.attainment} for p in g.probes],
            }
            for d, g in zip(fleets, found, strict=True)
        ],
        "at_rate_rps": rate,
        "at_rate": {k: p.row for k, p in at.items()},
        "metrics": m,
        "paper": PAPER_FIGURES,
        "rows": rows(m),
        "targets": targets(m),
        "wall_s": time.perf_counter() - started,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdd sim paper", description=__doc__.split("\n")[0])
    d = Scenario()
    p.add_argument(
        "--scenario",
        choices=sorted(REGIMES),
        default=DEFAULT_REGIME,
        help=f"the model and chips per instance (default {DEFAULT_REGIME}: the paper's regime)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smaller fleet (the scenario's quick scale: half, or a tenth for 7b-dense), 10 s probes",
    )
    p.add_argument(
        "--no-share-in-flight",
        action="store_true",
        help="each request sends its MD every block it lacks, even one already on its way",
    )
    p.add_argument(
        "--scale", type=float, default=None, help=f"fleet counts and rates x this (default {d.scale:g})"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds of arrivals per probe (default {d.duration_s:g})",
    )
    p.add_argument("--wan-gbps", type=float, default=d.wan_gbps, help="the cross-DC line's bandwidth, Gbit/s")
    p.add_argument("--rtt-ms", type=float, default=d.rtt_s * 1000, help="the line's round trip, ms")
    p.add_argument("--line-price", type=float, default=d.line_price, help="the line's USD per hour")
    p.add_argument("--jobs", type=int, default=d.jobs, help="searches run in parallel (processes)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="bench/out/sim_paper.json")
    add_quiet_option(p)
    return p


def scenario(args: argparse.Namespace) -> Scenario:
    regime = REGIMES[args.scenario]
    scale = args.scale if args.scale is not None else regime.quick_scale if args.quick else 1.0
    duration = args.duration if args.duration is not None else 10.0 if args.quick else Scenario.duration_s
    return Scenario(
        scale,
        duration,
        args.seed,
        args.wan_gbps,
        args.rtt_ms / 1000,
        Scenario.jitter_s,
        args.line_price,
        Scenario.rel_tol,
        max(1, args.jobs),
        args.scenario,
        not args.no_share_in_flight,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(scenario(args))
    save_report(result, Path(args.out), table=print_table, figures=figure)
    return 0
