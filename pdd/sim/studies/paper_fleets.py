"""The paper's scenarios and fleets, in chips: the regimes (model, chips, traffic, SLA), the
same-DC, PDD and naive cross-DC fleets built from them, their prices and the workload.
`pdd sim paper` (paper.py) searches their goodput; paper_report.py prints and plots it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from pdd.sim.fleet.deployment import Deployment, LinkSpec, RoleSpec, naive, pdd, same_dc
from pdd.sim.fleet.simulator import SimSettings
from pdd.sim.hardware import profiles
from pdd.sim.hardware.chip import Chip, with_batch_cap
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.hardware.step_cost import Linear, StepCost
from pdd.sim.studies.goodput import Window
from pdd.sim.studies.sla import Sla
from pdd.sim.workloads.agentic import (
    PAPER,
    PAPER_64K,
    PAPER_SESSIONS,
    AgenticParams,
    agentic_open_loop,
    fixed_hit_open_loop,
)
from pdd.sim.workloads.workload import Workload
from shared.config import RouterSettings

BLOCK_SIZE = 512
BASELINE_A, PDD_A, PDD_B = 88, 43, 32  # the paper's fleets, in chips
PREMIUMS = (1.20, 1.30)  # B's price over A's (the paper's 20-30%); 1.25 in the fleets' costs shown
SPLITS = (0.375, 0.5, 0.625, 0.75)  # same-DC: P's share of the fleet
RELAY_SHARES = (0.05, 0.1)  # PDD: RLD's share of the 43 A, where the scenario publishes none
SLA_64K = Sla(ttft_s=8.0, tpot_s=0.1, max_gap_s=1.0, attainment=0.9)


@dataclass(frozen=True)
class Regime:
    """What is served, on which chips and lines: one named scenario of `--scenario`."""

    model: str  # pdd/sim/hardware/models/<model>.json
    tp: int  # chips per instance, every role (tensor parallel)
    sla: Sla
    start_rps: float  # the goodput search's first rate at full scale
    quick_scale: float  # --quick's fleet scale (whole instances per role)
    traffic: AgenticParams = PAPER
    kv_layers: int | None = None  # the model with this many full-attention layers (pdd sim map)
    a: str = "gpu-a"  # P's and RLD's chip (and same-DC's)
    b: str = "gpu-b"  # MD's chip
    relay_chips: int | None = None  # the relay's chips as published (None: RELAY_SHARES searched)
    splits: tuple[float, ...] = SPLITS
    line_gbps: float = 400.0
    kv_token_bytes: int | None = None  # the model's KV bytes per token set (pdd sim map)
    b_speed: float = 1.0  # B's step times divided by this (pdd sim map: B's decode per dollar)
    fixed_hit: float | None = None  # every request hits this share of its prompt (pdd sim map)


def model_of(r: Regime) -> ModelSpec:
    spec = profiles.model_spec(r.model)
    if r.kv_layers:
        spec = replace(spec, kv_layers=r.kv_layers)
    return replace(spec, kv_token_bytes=r.kv_token_bytes) if r.kv_token_bytes else spec


REGIMES = {
    "published": Regime(
        "deepseek-v4-class",
        1,
        Sla(ttft_s=15.0, tpot_s=0.1, max_gap_s=2.0, attainment=0.9),
        16.0,
        0.25,
        PAPER_SESSIONS,
        a="h100-sxm",
        b="h200-sxm",
        relay_chips=3,
        splits=(0.375, 0.5, 0.625, 0.75, 0.8),
        line_gbps=25.0,
    ),
    "64k-moe": Regime("qwen3-235b-a22b-fp8", 4, SLA_64K, 8.0, 0.5, PAPER_64K),
    "64k-hybrid": Regime("qwen3-next-80b-a3b-fp8", 2, SLA_64K, 64.0, 0.5, PAPER_64K),
    "7b-dense": Regime("qwen2.5-7b", 1, replace(SLA_64K, ttft_s=4.0), 64.0, 0.1),
}
DEFAULT_REGIME = "published"


@dataclass(frozen=True)
class Scenario:
    scale: float = 1.0
    lifetimes: float = 3.0  # the measuring window, in SLA lifetimes (goodput.Window)
    warmup: float = 2.0  # the warm-up, in SLA lifetimes
    seed: int = 0
    wan_gbps: float | None = None  # None: the regime's line
    rtt_s: float = 0.02
    jitter_s: float = 0.005
    line_price: float = 1.0
    rel_tol: float = 0.03
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
    def gbps(self) -> float:
        return self.wan_gbps if self.wan_gbps is not None else self.r.line_gbps

    @property
    def line(self) -> LinkSpec:
        """The cross-DC line; a scaled-down fleet gets a line scaled down with it."""
        return LinkSpec(self.gbps * self.scale * 1e9 / 8, self.rtt_s / 2, self.jitter_s, self.line_price)

    @property
    def window(self) -> Window:
        t = self.r.traffic
        return Window.for_sla(self.r.sla, (t.output_min + t.output_max) / 2, self.lifetimes, self.warmup)

    @property
    def settings(self) -> SimSettings:
        router = RouterSettings(default_bandwidth_bps=self.line.bandwidth_Bps, default_rtt_s=self.rtt_s)
        return SimSettings(router=router, seed=self.seed, share_in_flight=self.share_in_flight)


# ---- the chips and fleets --------------------------------------------------------------------
def decode_context(r: Regime) -> int:
    """A decoding sequence's typical context: the traffic's mean prompt and half its answer."""
    t = r.traffic
    prompt = (t.new_min + t.context_max) // 2 if t.fresh_tasks else (t.new_min + t.new_max) // 2
    return prompt + (t.output_min + t.output_max) // 4


def chip(sc: Scenario, profile: str, group: int, decodes: bool) -> Chip:
    """An instance of `profile` in a group of `group` chips (an expert-parallel model's experts
    spread over them); a decoder's batch cap from its memory and the TPOT target (with a 10%
    margin for the steps a handoff's extend adds)."""
    r, model = sc.r, model_of(sc.r)
    c = profiles.chip(profile, model, r.tp, max(1, group))
    if profile == r.b and r.b_speed != 1.0:
        c = replace(c, step=faster(c.step, r.b_speed))
    if not decodes:
        return c
    return with_batch_cap(c, 0.9 * r.sla.tpot_s, decode_context(r), model.kv_bytes_per_token)


def faster(step: StepCost, factor: float) -> StepCost:
    """Every compute and memory term of a step divided by `factor` (its fixed overhead kept)."""

    def div(x: Linear) -> Linear:
        return Linear(*(v / factor for v in asdict(x).values()))

    return StepCost(step.overhead_s, div(step.compute), div(step.memory))


def price(sc: Scenario, premium: float) -> tuple[float, float]:
    """(A's, B's) price per chip-hour: A's profile's, B at `premium` x A."""
    a = float(profiles.load_profile(sc.r.a)["price_per_hour"])
    return a, a * premium


def priced(d: Deployment, sc: Scenario, premium: float = 1.25) -> Deployment:
    """The deployment with every instance priced per chip: A at its profile's, B at premium x."""
    a, b = price(sc, premium)

    def at(spec: RoleSpec | None) -> RoleSpec | None:
        if spec is None:
            return None
        per_chip = b if spec.chip.name == sc.r.b and sc.r.b != sc.r.a else a
        return replace(spec, chip=replace(spec.chip, price_per_hour=per_chip * spec.chip.chips))

    return replace(d, prefill=at(d.prefill), decode=at(d.decode), relay=at(d.relay))


def same_dc_fleet(sc: Scenario, prefill_chips: int) -> Deployment:
    tp, a = sc.r.tp, sc.r.a
    p, dec = prefill_chips // tp, (BASELINE_A - prefill_chips) // tp
    ps, ds = max(1, round(p * sc.scale)), max(1, round(dec * sc.scale))
    pre = RoleSpec(ps, chip(sc, a, prefill_chips, False))
    return priced(
        same_dc(pre, RoleSpec(ds, chip(sc, a, BASELINE_A - prefill_chips, True)), f"same-dc {ps}P+{ds}D"), sc
    )


def pdd_fleet(sc: Scenario, relay_chips: int) -> Deployment:
    """P and the relay are one group of A (the relay's ranks decode), MD a group of B."""
    tp, r = sc.r.tp, sc.r
    p = max(1, round((PDD_A - relay_chips) // tp * sc.scale))
    rl, md = max(1, round(relay_chips // tp * sc.scale)), sc.count(PDD_B)
    d = pdd(
        RoleSpec(p, chip(sc, r.a, PDD_A, False)),
        RoleSpec(rl, chip(sc, r.a, PDD_A, True)),
        RoleSpec(md, chip(sc, r.b, PDD_B, True)),
        sc.line,
        f"pdd {p}P+{rl}RLD+{md}MD",
    )
    return priced(d, sc)


def naive_fleet(sc: Scenario) -> Deployment:
    p, md = sc.count(PDD_A), sc.count(PDD_B)
    pre, dec = RoleSpec(p, chip(sc, sc.r.a, PDD_A, False)), RoleSpec(md, chip(sc, sc.r.b, PDD_B, True))
    return priced(naive(pre, dec, sc.line, f"naive {p}P+{md}MD"), sc)


def candidates(sc: Scenario) -> list[Deployment]:
    """The same-DC splits, the PDD relay sizes and the naive fleet, each to be searched."""
    tp = sc.r.tp
    splits = sorted({min(BASELINE_A - tp, max(tp, round(BASELINE_A * f / tp) * tp)) for f in sc.r.splits})
    if sc.r.relay_chips is not None:
        relays = [sc.r.relay_chips]
    else:
        relays = sorted({max(tp, round(PDD_A * f / tp) * tp) for f in RELAY_SHARES})
    return [
        *filter(None, (_fits(same_dc_fleet, sc, p) for p in splits)),
        *(pdd_fleet(sc, r) for r in relays),
        naive_fleet(sc),
    ]


def _fits(make, sc: Scenario, chips: int) -> Deployment | None:
    """A same-DC split whose decode group is too small to hold the model's weights is none."""
    try:
        return make(sc, chips)
    except ValueError:
        return None


def cost_change(sc: Scenario, premium: float) -> float:
    """The paper's fleets' cost per hour, PDD's over same-DC's minus one, B at `premium` x A,
    counting only chips that serve: 43 // tp and 32 // tp instances of tp chips and the line
    against 88 // tp instances."""
    a, b = price(sc, premium)
    tp = sc.r.tp
    baseline = BASELINE_A // tp * tp * a
    return (PDD_A // tp * tp * a + PDD_B // tp * tp * b + sc.line_price) / baseline - 1.0


def fixed_shape(r: Regime) -> tuple[int, int]:
    """A fixed-hit request's prompt and answer: the traffic's mean prompt (whole blocks) and
    its mean answer (the bathtub's and `pdd sim map --fixed-hit`'s)."""
    t = r.traffic
    return (t.new_min + t.context_max) // 2 // BLOCK_SIZE * BLOCK_SIZE, (t.output_min + t.output_max) // 2


def make_workload(sc: Scenario, rate_rps: float) -> Workload:
    if sc.r.fixed_hit is not None:
        prompt, out = fixed_shape(sc.r)
        return fixed_hit_open_loop(
            sc.r.fixed_hit, rate_rps, sc.window.arrivals_s, prompt, out, BLOCK_SIZE, sc.seed
        )
    return agentic_open_loop(sc.r.traffic, rate_rps, sc.window.arrivals_s, BLOCK_SIZE, seed=sc.seed)
