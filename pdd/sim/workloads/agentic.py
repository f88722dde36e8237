"""The agentic workload: multi-turn agent sessions with a paper-like prefix-hit mix.

One generator for `pdd bench e2e` (plans and prompt shapes, turned into tokens by the bench)
and for the simulator (the same shapes, as chained block hashes). A request's kind:
  high     a continuation (or a fresh task on the whole system prompt) aiming above
           `high_hit_min` prefix hit;
  low      a long new part (a document, a code base) on the session, or a new session that
           keeps only part of the system prompt: hit below `high_hit_min`;
  outlier  a long one-off document with a short answer (not part of the session).
A session's next turn is its previous prompt + the model's output + new tokens, so the prefix
it hits includes the previous output: MD holds the full blocks of prompt and output (all but
the last token, whose KV is never computed). `output_block_hashes` names those output blocks
so a simulator can cache them as MD does; the generators build continuations on them.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, fields
from typing import Any

from pdd.sim.workloads.workload import SimRequest, Workload
from shared.engine.hashing import hash_block

_OUTPUT_TAG = 0xFFFF_FFFE  # content ids of output blocks: no fresh block (a counter) reaches it
_U32 = 0xFFFF_FFFF


@dataclass(frozen=True)
class AgenticParams:
    """The generator's knobs; the defaults are `pdd bench e2e`'s (small contexts for the CPU)."""

    requests: int = 36  # closed loop: requests in all
    clients: int = 3  # closed loop: concurrent agents
    seed: int = 0
    shared_prefix: int = 1536  # system prompt shared by every session
    new_min: int = 1024  # prompt tokens of a new low-hit session
    new_max: int = 2560
    append_min: int = 8  # tokens a continuation adds at least
    context_max: int = 3584  # prompt + output cap; a longer session restarts
    high_hit_frac: float = 0.75  # share of (non-outlier) requests aiming above high_hit_min
    high_hit_min: float = 0.95
    low_hit_min: float = 0.0  # low-hit requests aim uniformly in [low_hit_min, high_hit_min)
    output_min: int = 32
    output_max: int = 192
    outlier_frac: float = 0.04  # long-input short-output requests
    outlier_input: int = 3072
    outlier_output: int = 8
    think_s: float = 0.0  # closed loop: an agent's pause between its turns
    turn_gap_s: float = 5.0  # open loop: mean time from a session's turn to its next one
    turn_min_s: float = 0.0  # open loop: ... at least this (its answer streams meanwhile)
    fresh_tasks: bool = False  # every new session is a new task (long, its own), whatever its kind

    @classmethod
    def from_args(cls, args: Any) -> AgenticParams:
        """From an argparse namespace (the bench's options); knobs it lacks keep their default."""
        given = vars(args)
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})


BENCH = AgenticParams()
# Paper scale (the PDD paper's agentic traffic): agent contexts of tens of thousands of tokens (a 16K system prompt with
# tool definitions, sessions growing to 64K), outputs of hundreds to ~1K tokens, 3.5% outliers
# of 64K in / 256 out (under the ~500-token "short output" of the anomalous-traffic filter).
# Low-hit requests aim at 60-95%: with 75% of requests above 95% the mean hit is then ~90%.
PAPER = AgenticParams(
    shared_prefix=16384,
    new_min=16384,
    new_max=32768,
    append_min=64,
    context_max=65536,
    low_hit_min=0.6,
    output_min=128,
    output_max=1024,
    outlier_frac=0.035,
    outlier_input=64000,
    outlier_output=256,
    turn_gap_s=10.0,
)

# The paper's 64K-in / 1K-out agentic scenario: every session reads a 48K shared context (the
# agent's system prompt and tool definitions, ~16K, and the project's files every task opens),
# a new task brings 56-64K of its own, turns grow a session to 72K (prompt and output), and
# answers are 512-1536 tokens (1K mean); outliers and the hit mix as PAPER's.
PAPER_64K = AgenticParams(
    shared_prefix=49152,
    new_min=57344,
    new_max=65536,
    append_min=64,
    context_max=73728,
    low_hit_min=0.6,
    output_min=512,
    output_max=1536,
    outlier_frac=0.035,
    outlier_input=64000,
    outlier_output=256,
    turn_gap_s=10.0,
)

# The published scenario's agentic traffic (64K in / 1K out), each session's hit from its own
# history: a 16K system prompt with tool definitions and the project's common files is all
# sessions share; a new task brings 40-56K (keeping the shared 16K), each turn adds the answer
# and a tool result, and a session restarts past 80K (prompts average ~64K). A turn follows the
# last one's answer (at least 120 s later: 1K tokens at the 100 ms TPOT target), so its prefix
# is on MD when it arrives. Low-hit turns (a long tool result, a new file) aim at 70-95%,
# high-hit turns above 95%; 3.5% are 64K-in / 256-out outliers: a ~89% mean hit per request,
# ~74% of requests above 95%.
PAPER_SESSIONS = AgenticParams(
    shared_prefix=16384,
    new_min=40960,
    new_max=57344,
    append_min=64,
    context_max=81920,
    high_hit_frac=0.8,
    low_hit_min=0.7,
    fresh_tasks=True,
    output_min=512,
    output_max=1536,
    outlier_frac=0.035,
    outlier_input=64000,
    outlier_output=256,
    turn_gap_s=10.0,
    turn_min_s=120.0,
)


@dataclass
class Step:
    kind: str  # "high" | "low" | "outlier"
    hit: float  # target prefix hit rate
    out: int  # output tokens
    seed: int


def draw_step(p: AgenticParams, rng: random.Random) -> Step:
    u = rng.random()
    if u < p.outlier_frac:
        return Step("outlier", 0.0, p.outlier_output, rng.getrandbits(32))
    if rng.random() < p.high_hit_frac:
        return Step(
            "high",
            rng.uniform(p.high_hit_min, 0.999),
            rng.randint(p.output_min, p.output_max),
            rng.getrandbits(32),
        )
    return Step(
        "low",
        rng.uniform(p.low_hit_min, p.high_hit_min),
        rng.randint(p.output_min, p.output_max),
        rng.getrandbits(32),
    )


def make_plans(p: AgenticParams) -> list[list[Step]]:
    """Per client, the kinds, target hit rates and output lengths of its requests (seeded)."""
    rng = random.Random(p.seed)
    plans: list[list[Step]] = [[] for _ in range(p.clients)]
    for i in range(p.requests):
        plans[i % p.clients].append(draw_step(p, rng))
    return plans


@dataclass(frozen=True)
class PromptShape:
    """A prompt = `keep` tokens of its base, then `fresh` new tokens.
    base: "session" (the session so far, prompt + output), "shared" (the system prompt) or
    "none" (an outlier's one-off document)."""

    base: str
    keep: int
    fresh: int
    new_session: bool


def prompt_shape(
    p: AgenticParams, step: Step, ctx_len: int, cached: int, shared_len: int, block: int, rng: random.Random
) -> PromptShape:
    """The shape of a step's prompt given the session so far (ctx_len tokens, of which the
    cache holds `cached`). rng draws a new low-hit session's length (the bench: Random(step.seed))."""
    room = p.context_max - step.out
    if step.kind == "outlier":
        return PromptShape("none", 0, min(p.outlier_input, room), False)
    if ctx_len and step.hit > 0:
        append = max(p.append_min, math.floor(cached / step.hit) - ctx_len)
        if ctx_len + append <= room:
            return PromptShape("session", ctx_len, append, False)
    # A new session (a new task): a high-hit one is the whole system prompt and a short
    # instruction; a low-hit one has a long fresh part and keeps step.hit of the system prompt.
    if step.kind == "high" and not p.fresh_tasks:
        fresh = max(p.append_min, math.floor(shared_len / step.hit) - shared_len)
        return PromptShape("shared", shared_len, min(fresh, room - shared_len), True)
    n = rng.randint(p.new_min, min(p.new_max, room))
    k = min(shared_len, int(step.hit * n) // block * block)
    return PromptShape("shared", k, n - k, True)


def output_block_hashes(req: SimRequest, block_size: int) -> tuple[int, ...]:
    """The blocks MD holds after `req` beyond its prompt's: the full blocks of prompt + output
    but the last token. The generators' continuations start with them (a turn's next prompt
    contains its output), so a simulator that caches them credits the output as MD does."""
    h = req.block_hashes[-1] if req.block_hashes else None
    out = []
    for j in range(len(req.block_hashes), (req.input_tokens + req.output_tokens - 1) // block_size):
        h = hash_block(h, (_OUTPUT_TAG, req.rid & _U32, req.rid >> 32, j), "output")
        out.append(h)
    return tuple(out)


# ---------------------------------------------------------------- hash-level sessions


class _Blocks:
    """Blocks of fresh content. A fresh block's chained hash is a value no other block has,
    so it is drawn rather than computed (hashing millions of blocks would take minutes): a
    prefix's hashes are still equal exactly when the prefix is, which is all a cache sees."""

    def __init__(self, seed: int | str) -> None:
        self.rng = random.Random(f"blocks-{seed}")

    def extend(self, hashes: tuple[int, ...] | list[int], n_blocks: int) -> tuple[int, ...]:
        """`hashes` followed by fresh blocks up to n_blocks in all."""
        fresh = n_blocks - len(hashes)
        if fresh <= 0:
            return tuple(hashes)
        draw = self.rng.getrandbits
        return (*hashes, *(draw(63) for _ in range(fresh)))


@dataclass
class _Session:
    ctx_len: int = 0  # prompt + output of the last turn
    held: tuple[int, ...] = ()  # what MD holds of it: prompt blocks + output blocks


class _Builder:
    """Requests of agentic sessions as block hashes (no token lists: fast at paper scale)."""

    def __init__(self, p: AgenticParams, block_size: int, blocks_seed: int | str) -> None:
        self.p, self.block = p, block_size
        self.blocks = _Blocks(blocks_seed)
        self.shared = self.blocks.extend([], p.shared_prefix // block_size)
        self.requests: list[SimRequest] = []

    def add(
        self, step: Step, sess: _Session, rng: random.Random, arrival_s: float, client: int | None
    ) -> None:
        s = prompt_shape(
            self.p, step, sess.ctx_len, len(sess.held) * self.block, self.p.shared_prefix, self.block, rng
        )
        n = s.keep + s.fresh
        base = (
            sess.held
            if s.base == "session"
            else self.shared[: s.keep // self.block]
            if s.base == "shared"
            else ()
        )
        hashes = self.blocks.extend(base, n // self.block)
        req = SimRequest(len(self.requests), arrival_s, n, step.out, tuple(hashes), client, step.kind)
        self.requests.append(req)
        if step.kind != "outlier":  # the agent's next turn builds on this prompt and its output
            sess.ctx_len = n + step.out
            sess.held = req.block_hashes + output_block_hashes(req, self.block)


def _closed_loop_seed(params: AgenticParams, model_id: str) -> str:
    return f"{model_id}-{params.seed}"


def closed_loop_shared_prefix(
    params: AgenticParams, block_size: int, model_id: str = "sim"
) -> tuple[int, ...]:
    """The block hashes of the shared system prompt in agentic_closed_loop's workload."""
    return _Blocks(_closed_loop_seed(params, model_id)).extend([], params.shared_prefix // block_size)


def agentic_closed_loop(params: AgenticParams, block_size: int, model_id: str = "sim") -> Workload:
    """What `pdd bench e2e --scenario agentic` runs: params.clients agents, each running its
    plan in order, params.think_s apart; the same prompt lengths and prefix structure as the bench
    (same plans, same per-step seeds), each client's k-th request listed in round k."""
    b = _Builder(params, block_size, _closed_loop_seed(params, model_id))
    plans = make_plans(params)
    sessions = [_Session() for _ in plans]
    for k in range(max(map(len, plans), default=0)):
        for ci, plan in enumerate(plans):
            if k < len(plan):
                b.add(plan[k], sessions[ci], random.Random(plan[k].seed), params.think_s, ci)
    return Workload(
        f"agentic-closed-{params.clients}x{params.requests}", block_size, tuple(b.requests), closed_loop=True
    )


def agentic_open_loop(
    params: AgenticParams, rate_rps: float, duration_s: float, block_size: int, seed: int = 0
) -> Workload:
    """Poisson arrivals at rate_rps for duration_s. Each arrival is the next turn of the session
    that has waited longest, if it has waited its think time (params.turn_min_s plus an
    exponential of mean params.turn_gap_s), else of a new session: the pool grows to about
    rate x (turn_min_s + turn_gap_s)."""
    rng = random.Random(seed)
    b = _Builder(params, block_size, seed)
    ready: list[tuple[float, int]] = []  # (when a session may send its next turn, session)
    sessions: list[_Session] = []
    t = rng.expovariate(rate_rps)
    while t < duration_s:
        step = draw_step(params, rng)
        if step.kind == "outlier":
            b.add(step, _Session(), rng, t, None)
        else:
            if ready and ready[0][0] <= t:
                si = heapq.heappop(ready)[1]
            else:
                si = len(sessions)
                sessions.append(_Session())
            b.add(step, sessions[si], rng, t, si)
            heapq.heappush(ready, (t + params.turn_min_s + rng.expovariate(1.0 / params.turn_gap_s), si))
        t += rng.expovariate(rate_rps)
    return Workload(f"agentic-open-{rate_rps:g}rps", block_size, tuple(b.requests))


def fixed_hit_open_loop(
    hit: float,
    rate_rps: float,
    duration_s: float,
    input_tokens: int,
    output_tokens: int,
    block_size: int,
    seed: int = 0,
    prefixes: int = 16,
) -> Workload:
    """Poisson arrivals whose prompts each reuse round(hit x blocks) leading blocks of one of
    `prefixes` prefixes (the first request of a prefix finds it uncached), then fresh blocks:
    every later request hits `hit` of its prompt to a block (the hit-rate bathtub)."""
    if not 0.0 <= hit <= 1.0:
        raise ValueError(f"hit {hit} is not in [0, 1]")
    rng = random.Random(seed)
    blocks = _Blocks(f"fixed-{seed}")
    n_blocks = input_tokens // block_size
    keep = min(n_blocks, round(hit * input_tokens / block_size))
    bases = [blocks.extend([], keep) for _ in range(prefixes)]
    reqs: list[SimRequest] = []
    t = rng.expovariate(rate_rps)
    while t < duration_s:
        hashes = blocks.extend(bases[rng.randrange(prefixes)], n_blocks)
        reqs.append(SimRequest(len(reqs), t, input_tokens, output_tokens, tuple(hashes), None, "fixed"))
        t += rng.expovariate(rate_rps)
    return Workload(f"fixed-hit-{hit:g}", block_size, tuple(reqs))


# ---------------------------------------------------------------- what a workload hits

HIT_BUCKETS = ((0.0, 0.90), (0.90, 0.95), (0.95, 0.96), (0.96, 0.97), (0.97, 0.98), (0.98, 0.99), (0.99, 1.0))


def prefix_hits(workload: Workload, outputs: bool = True) -> list[float]:
    """Per request, in listed order, the share of its prompt found in an infinite cache of all
    earlier requests' blocks (with their output blocks when `outputs`, as MD holds them).
    Hashes are chained, so the cached blocks of a prompt are a prefix: found by bisection."""
    held: set[int] = set()
    bs = workload.block_size
    out = []
    for r in workload.requests:
        hs = r.block_hashes
        lo, hi = 0, len(hs)  # hs[:lo] held, hs[hi:] not
        while lo < hi:
            mid = (lo + hi) // 2
            if hs[mid] in held:
                lo = mid + 1
            else:
                hi = mid
        out.append(lo * bs / r.input_tokens if r.input_tokens else 0.0)
        held.update(hs)
        if outputs:
            held.update(output_block_hashes(r, bs))
    return out


def hit_profile(workload: Workload, outputs: bool = True) -> dict:
    """Mean prefix hit, share above 95%, the paper's seven-bucket histogram (0-90% ... 99-100%),
    the outlier share (None for an unlabelled trace) and, open loop, the arrival rate."""
    hits = prefix_hits(workload, outputs)
    n = max(len(hits), 1)
    buckets = {
        f"{lo * 100:g}-{hi * 100:g}%": sum(lo <= h < hi or (hi == 1.0 and h == 1.0) for h in hits) / n
        for lo, hi in HIT_BUCKETS
    }
    kinds = [r.kind for r in workload.requests if r.kind]
    duration = workload.duration_s
    return {
        "requests": len(hits),
        "mean": sum(hits) / n,
        "above_95": sum(h > 0.95 for h in hits) / n,
        "buckets": buckets,
        "outlier_share": kinds.count("outlier") / n if kinds else None,
        "rate_rps": len(hits) / duration if duration > 0 else None,
        "input_tokens_mean": sum(r.input_tokens for r in workload.requests) / n,
        "output_tokens_mean": sum(r.output_tokens for r in workload.requests) / n,
    }
