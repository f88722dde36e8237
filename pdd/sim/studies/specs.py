"""What the `pdd sim` commands are asked for, from their flags: deployments, a workload, an SLA
and overrides of the real policy settings. Each add_*_options(parser) adds one group of flags;
the matching *_from_args(args, ...) turns the parsed flags into the simulator's objects and
raises SpecError (a ValueError with a message for the user) on anything it cannot build.

Deployments: --deployment takes kinds (same-dc, naive, pdd), repeated or comma-separated; the
role counts and profiles come from --prefill/--relay/--decode and --*-profile, and one
deployment may override them after a colon, e.g.

    --deployment same-dc:prefill=44,decode=44 --deployment pdd:prefill=27,relay=16,decode=32,decode-profile=gpu-b
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from pdd.sim.fleet.deployment import Deployment, LinkSpec, RoleSpec, naive, pdd, same_dc
from pdd.sim.fleet.simulator import SimSettings
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.hardware.profiles import chip, model_spec
from pdd.sim.studies.sla import Sla
from pdd.sim.workloads.agentic import BENCH, PAPER, agentic_open_loop, fixed_hit_open_loop
from pdd.sim.workloads.trace import read_mooncake
from pdd.sim.workloads.workload import Workload
from shared.config import RelaySettings, RouterSettings

DEFAULT_MODEL = "qwen2.5-7b"
KINDS = ("same-dc", "naive", "pdd")
ROLE_KEYS = ("prefill", "relay", "decode")  # counts; "<role>-profile" names the chip
WORKLOADS = "agentic | agentic-bench | fixed-hit:H | trace:PATH"


class SpecError(ValueError):
    """A flag the simulator cannot build from; its message is for the user."""


# ---- deployments -----------------------------------------------------------------------
def add_deployment_options(ap: argparse.ArgumentParser, deployments: str = "same-dc,naive,pdd") -> None:
    g = ap.add_argument_group("deployment")
    g.add_argument(
        "--deployment",
        action="append",
        default=None,
        help=f"kinds to compare, the first the baseline ({', '.join(KINDS)}); repeat or comma-separate; "
        f"KIND:prefill=N,relay=R,decode=M,decode-profile=P,name=X overrides the flags below "
        f"for one (default {deployments})",
    )
    g.set_defaults(deployment_default=deployments)
    g.add_argument("--prefill", type=int, default=4, help="P instances (default 4)")
    g.add_argument("--relay", type=int, default=1, help="RLD instances beside P, pdd only (default 1)")
    g.add_argument("--decode", type=int, default=4, help="MD instances (D for same-dc) (default 4)")
    for role in ROLE_KEYS:
        g.add_argument(
            f"--{role}-profile",
            default="gpu-a",
            help=f"hardware profile of {role} (`pdd sim profiles`; default gpu-a)",
        )
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"model shape (default {DEFAULT_MODEL})")
    g.add_argument("--wan-gbps", type=float, default=25.0, help="cross-DC line, Gbit/s (default 25)")
    g.add_argument("--wan-ms", type=float, default=5.0, help="cross-DC one-way delay, ms (default 5)")
    g.add_argument(
        "--wan-jitter-ms", type=float, default=1.0, help="uniform jitter per crossing, ms (default 1)"
    )
    g.add_argument("--wan-price", type=float, default=0.0, help="the line's cost, $/h (default 0)")


def link_spec(
    gbps: float, one_way_ms: float, jitter_ms: float = 0.0, price_per_hour: float = 0.0
) -> LinkSpec:
    """A link from the units people quote: Gbit/s and milliseconds."""
    if gbps <= 0 or one_way_ms < 0 or jitter_ms < 0:
        raise SpecError(
            f"the WAN needs a positive bandwidth and non-negative delays (got {gbps} Gbit/s, "
            f"{one_way_ms} ms, jitter {jitter_ms} ms)"
        )
    return LinkSpec(gbps * 1e9 / 8, one_way_ms / 1e3, jitter_ms / 1e3, price_per_hour)


def parse_deployment_item(item: str) -> tuple[str, dict[str, str]]:
    """ "pdd:relay=2,decode-profile=gpu-b" -> ("pdd", {"relay": "2", "decode-profile": "gpu-b"})."""
    kind, _, rest = item.strip().partition(":")
    if kind not in KINDS:
        raise SpecError(f"unknown deployment {kind!r}; known: {', '.join(KINDS)}")
    known = {*ROLE_KEYS, *(f"{r}-profile" for r in ROLE_KEYS), "name"}
    overrides = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq or key not in known:
            raise SpecError(
                f"in deployment {item!r}: {pair!r} is not KEY=VALUE with KEY one of {', '.join(sorted(known))}"
            )
        overrides[key] = value
    return kind, overrides


def deployment_items(args: argparse.Namespace) -> list[str]:
    given = args.deployment or [args.deployment_default]
    return [item for arg in given for item in _split_items(arg)]


def _split_items(arg: str) -> list[str]:
    """Split on commas, but a KEY=VALUE part belongs to the item before ("same-dc,pdd:relay=2,decode=3"
    is two items)."""
    items: list[str] = []
    for part in arg.split(","):
        if items and "=" in part and ":" not in part:
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def deployments_from_args(args: argparse.Namespace, model: ModelSpec) -> list[Deployment]:
    wan = link_spec(args.wan_gbps, args.wan_ms, args.wan_jitter_ms, args.wan_price)
    out: list[Deployment] = []
    for item in deployment_items(args):
        kind, o = parse_deployment_item(item)
        counts = {r: positive_int(o.get(r, getattr(args, r)), f"{r} count") for r in ROLE_KEYS}
        profiles = {r: o.get(f"{r}-profile", getattr(args, f"{r}_profile")) for r in ROLE_KEYS}
        taken = {d.name for d in out}
        name = o.get("name") or next(
            n for n in (kind, *(f"{kind}-{i}" for i in range(2, 99))) if n not in taken
        )
        out.append(build_deployment(kind, counts, profiles, model, wan, name))
    return out


def positive_int(value: int | str, what: str) -> int:
    """value as a whole number of at least 1, else a SpecError naming `what`."""
    try:
        n = int(value)
    except ValueError:
        raise SpecError(f"{what} {value!r} is not a whole number") from None
    if n < 1:
        raise SpecError(f"{what} must be at least 1 (got {n})")
    return n


def build_deployment(
    kind: str,
    counts: dict[str, int],
    profiles: dict[str, str],
    model: ModelSpec,
    wan: LinkSpec,
    name: str | None = None,
) -> Deployment:
    """One deployment of `kind`; counts and profiles by role ("prefill", "relay", "decode"),
    the relay's ignored unless kind is pdd."""
    role = {
        r: RoleSpec(counts[r], _chip(profiles[r], model)) for r in ROLE_KEYS if kind == "pdd" or r != "relay"
    }
    name = name or kind
    if kind == "same-dc":
        return same_dc(role["prefill"], role["decode"], name)
    if kind == "naive":
        return naive(role["prefill"], role["decode"], wan, name)
    if kind == "pdd":
        return pdd(role["prefill"], role["relay"], role["decode"], wan, name)
    raise SpecError(f"unknown deployment {kind!r}; known: {', '.join(KINDS)}")


def _chip(profile: str, model: ModelSpec):
    try:
        return chip(profile, model)
    except ValueError as e:
        raise SpecError(str(e)) from None


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    try:
        return model_spec(args.model)
    except ValueError as e:
        raise SpecError(str(e)) from None


# ---- workloads -------------------------------------------------------------------------
def add_workload_options(ap: argparse.ArgumentParser, rate: float = 8.0, duration: float = 60.0) -> None:
    g = ap.add_argument_group("workload")
    g.add_argument(
        "--workload",
        default="agentic",
        help=f"{WORKLOADS}: the paper-scale agentic generator, the bench's small one, every prompt "
        f"hitting H of its prefix, or a Mooncake JSONL trace (default agentic)",
    )
    g.add_argument(
        "--rate",
        type=float,
        default=None,
        help=f"offered requests/s (default {rate:g}; a trace: its own rate unless given)",
    )
    g.set_defaults(rate_default=rate)
    g.add_argument(
        "--duration",
        type=float,
        default=duration,
        help=f"seconds of arrivals (default {duration:g}; a trace: all of it)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--block-size", type=int, default=None, help="tokens per cached block (default 512; agentic-bench 16)"
    )
    g.add_argument("--input-tokens", type=int, default=8192, help="fixed-hit: prompt tokens (default 8192)")
    g.add_argument("--output-tokens", type=int, default=256, help="fixed-hit: output tokens (default 256)")


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload that can be offered at any rate (the goodput sweep asks for several)."""

    kind: str  # "agentic" | "agentic-bench" | "fixed-hit" | "trace"
    rate_rps: float  # the rate of at(None)
    duration_s: float
    seed: int = 0
    block_size: int = 512
    hit: float = 0.0  # fixed-hit
    input_tokens: int = 8192  # fixed-hit
    output_tokens: int = 256  # fixed-hit
    trace: Workload | None = None  # trace: the requests as read, at the trace's own rate

    def at(self, rate_rps: float | None = None) -> Workload:
        """The workload offered at rate_rps (default: self.rate_rps)."""
        rate = rate_rps or self.rate_rps
        if self.kind == "trace":
            return self.trace.at_rate(rate / trace_rate(self.trace))
        if self.kind == "fixed-hit":
            return fixed_hit_open_loop(
                self.hit,
                rate,
                self.duration_s,
                self.input_tokens,
                self.output_tokens,
                self.block_size,
                self.seed,
            )
        params = PAPER if self.kind == "agentic" else BENCH
        return agentic_open_loop(params, rate, self.duration_s, self.block_size, self.seed)

    def with_hit(self, hit: float) -> WorkloadSpec:
        return replace(self, kind="fixed-hit", hit=hit, trace=None)


def trace_rate(w: Workload) -> float:
    """A trace's own mean rate: requests over the span of their arrivals."""
    return len(w.requests) / w.duration_s if w.duration_s > 0 else float(len(w.requests))


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    kind, _, arg = args.workload.partition(":")
    block = args.block_size or (BENCH_BLOCK if kind == "agentic-bench" else 512)
    base = WorkloadSpec(
        kind,
        args.rate or args.rate_default,
        args.duration,
        args.seed,
        block,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
    )
    if kind in ("agentic", "agentic-bench") and not arg:
        spec = base
    elif kind == "fixed-hit" and arg:
        spec = replace(base, hit=_hit(arg))
    elif kind == "trace" and arg:
        trace = _read_trace(arg, block)
        spec = replace(
            base, trace=trace, rate_rps=args.rate or trace_rate(trace), duration_s=trace.duration_s
        )
    else:
        raise SpecError(f"unknown workload {args.workload!r}; use {WORKLOADS}")
    if spec.rate_rps <= 0 or spec.duration_s <= 0:
        raise SpecError(
            f"the workload needs a positive --rate and --duration (got {spec.rate_rps}, {spec.duration_s})"
        )
    return spec


BENCH_BLOCK = 16  # the engine's block size (shared/config.py), which `pdd bench e2e` runs with


def _hit(text: str) -> float:
    try:
        hit = float(text)
    except ValueError:
        hit = -1.0
    if not 0.0 <= hit <= 1.0:
        raise SpecError(f"fixed-hit:{text}: the hit rate must be a number in [0, 1]")
    return hit


def _read_trace(path: str, block: int) -> Workload:
    try:
        trace = read_mooncake(path, block)
    except OSError as e:
        raise SpecError(f"cannot read trace {path}: {e.strerror}") from None
    if not trace.requests:
        raise SpecError(f"trace {path} has no requests")
    return trace


# ---- the SLA ---------------------------------------------------------------------------
def add_sla_options(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("SLA")
    d = Sla()
    g.add_argument(
        "--sla-ttft", type=float, default=d.ttft_s, help=f"seconds to the first token (default {d.ttft_s:g})"
    )
    g.add_argument(
        "--sla-tpot",
        type=float,
        default=d.tpot_s,
        help=f"mean seconds per output token (default {d.tpot_s:g})",
    )
    g.add_argument(
        "--sla-gap", type=float, default=None, help="longest stall between two tokens, s (default: not held)"
    )
    g.add_argument(
        "--sla-attainment",
        type=float,
        default=d.attainment,
        help=f"share of requests that must meet it (default {d.attainment:g})",
    )


def sla_from_args(args: argparse.Namespace) -> Sla:
    if not 0.0 < args.sla_attainment <= 1.0:
        raise SpecError(f"--sla-attainment must be in (0, 1], got {args.sla_attainment}")
    return Sla(args.sla_ttft, args.sla_tpot, args.sla_gap, args.sla_attainment)


# ---- the policy and engine settings ----------------------------------------------------
def add_settings_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a setting: router.* (RouterSettings), relay.* (RelaySettings) or sim.* "
        "(max_batched_tokens, prefill_chunk, max_num_seqs), e.g. router.wan_time_threshold_s=1.0",
    )


SECTIONS = {"router": RouterSettings, "relay": RelaySettings}
SIM_FIELDS = ("max_batched_tokens", "prefill_chunk", "max_num_seqs")  # of SimSettings


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    return sim_settings(args.set, seed=args.seed)


def sim_settings(overrides: list[str], seed: int = 0) -> SimSettings:
    """SimSettings with `overrides` ("router.wan_time_threshold_s=1.0", ...) applied, each
    value checked by its settings class."""
    fields: dict[str, dict[str, str]] = {"router": {}, "relay": {}, "sim": {}}
    for item in overrides:
        key, eq, value = item.partition("=")
        section, _, name = key.partition(".")
        if not eq or section not in fields or not _known(section, name):
            raise SpecError(
                f"--set {item!r}: expected router.FIELD=V, relay.FIELD=V or sim.FIELD=V with FIELD one of "
                f"the settings' fields ({_field_names(section)})"
            )
        fields[section][name] = value
    try:
        router, relay = (SECTIONS[s](**fields[s]) for s in SECTIONS)
    except ValueError as e:  # pydantic's ValidationError
        raise SpecError(f"--set: {e}") from None
    sim = {name: positive_int(value, f"--set sim.{name}") for name, value in fields["sim"].items()}
    return SimSettings(router=router, relay=relay, seed=seed, **sim)


def _known(section: str, name: str) -> bool:
    return name in (SECTIONS[section].model_fields if section in SECTIONS else SIM_FIELDS)


def _field_names(section: str) -> str:
    if section in SECTIONS:
        return ", ".join(SECTIONS[section].model_fields)
    return ", ".join(SIM_FIELDS) if section == "sim" else "see --help"
