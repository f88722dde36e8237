"""`pdd sim calibrate`: time the real engine on this machine and fit the step-cost model to it.

Two kinds of steps over a grid, each timed around `LLMEngine.step()` (scheduling and sampling
included, as the simulator's steps are), after warm-up steps, as the median of repeats:
  decode  B sequences decoding one token each after a context of C tokens (the B sequences
          share a C-token prefix from the prefix cache, so their prefill is not paid B times);
  chunk   one sequence computing N new tokens after C tokens served from the prefix cache.
The load of every timed step is read from the engine's counters, not assumed. The fit is
non-negative least squares of overhead + compute·load (relative error weighted: small steps
matter as much as large ones), with a second line (the memory term) where the points show a
second regime; written as a "calibrated" profile of this model on this machine.

    pdd sim calibrate [--quick] [--model small|default|PATH] [--dtype float32] [--device cpu] [--threads N] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdd.benchkit.cpu import host_busy_s
from pdd.benchkit.progress import add_quiet_option, progress
from pdd.sim.hardware.profiles import (
    PRESET_NAMES,
    SERVED_DEFAULT,
    load_profile,
    model_spec,
    profile_dir_for_writing,
    step_cost_from_json,
    step_cost_to_json,
)
from pdd.sim.hardware.step_cost import Linear, StepCost, StepLoad, chunk_load, decode_load

# (load field, its Linear coefficient): what the compute term is fitted on
FIELDS = (("tokens", "per_token"), ("attn", "per_attn"), ("kv_read", "per_kv_read"), ("seqs", "per_seq"))
MEMORY_COLUMNS = np.array([1.0, 1.0, 0.0, 1.0, 0.0])  # a memory-bound step: const (weights) + KV bytes
CPU_PRICE = (
    0.10,
    "assumption: about what a 2-vCPU cloud VM costs on demand (AWS c7a.large, 2 vCPU "
    "AMD EPYC, us-east-1: about $0.10/h; https://aws.amazon.com/ec2/pricing/on-demand/)",
)


@dataclass(frozen=True)
class Grid:
    batches: tuple[int, ...]  # decode: sequences per step
    decode_contexts: tuple[int, ...]  # decode: tokens each sequence already has (block multiples)
    chunks: tuple[int, ...]  # chunk: new tokens per step
    chunk_contexts: tuple[int, ...]  # chunk: cached tokens before them (block multiples)
    warmup: int = 2
    repeats: int = 5


# The default spans what `pdd bench e2e` runs on the small preset: prompts up to ~3.5k tokens,
# chunks up to the engine's default 2048-token budget, a few to a dozen sequences decoding.
DEFAULT_GRID = Grid((1, 4, 8, 16), (64, 512, 1536, 3072), (16, 128, 512, 1024), (0, 1024, 2048), warmup=1)
QUICK_GRID = Grid((1, 8), (32, 256), (32, 128), (0, 256), warmup=1, repeats=3)
# A GPU's steps stay flat (fixed per-step cost) until batches and chunks are large: reach
# the sizes where compute and memory bandwidth show.
GPU_GRID = Grid((1, 8, 32, 64), (512, 2048, 8192), (512, 2048, 8192), (0, 4096), warmup=2)


@dataclass(frozen=True)
class Point:
    kind: str  # "decode" | "chunk"
    size: int  # decode: batch; chunk: new tokens
    context: int
    load: StepLoad  # of the median-time step
    seconds: float  # median of the repeats


# ---- fitting ---------------------------------------------------------------------------
def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """min ‖a·x − b‖ subject to x ≥ 0 (Lawson–Hanson active set)."""
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        if free.all() or grad[~free].max(initial=0.0) <= 1e-12 * max(1.0, np.abs(grad).max()):
            return x
        free[np.argmax(np.where(free, -np.inf, grad))] = True
        while True:  # solve on the free set; step back until every free coefficient is positive
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            bad = free & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    raise RuntimeError("nnls did not converge")


def _fit_line(
    rows: np.ndarray, t: np.ndarray, on: np.ndarray, columns: np.ndarray | None = None
) -> np.ndarray:
    """Non-negative [const, per field] coefficients fitted to the points `on` (only `columns`
    may be non-zero), relative error weighted."""
    rows = rows if columns is None else rows * columns
    weighted = rows[on] / t[on, None]  # each row divided by its time: the residuals are relative
    scale = np.linalg.norm(weighted, axis=0)
    scale[scale == 0] = 1.0  # a field these points never vary stays at 0
    return nnls(weighted / scale, np.ones(int(on.sum()))) / scale


def _loss(predicted: np.ndarray, t: np.ndarray) -> float:
    return float(np.mean(((predicted - t) / t) ** 2))


def fit_step_cost(loads: list[StepLoad], seconds: list[float]) -> StepCost:
    """One line through every point, or, where it fits better, max(compute, memory) of two lines
    (a second regime, such as KV reads falling out of the caches): from several first splits
    of the points (by KV read, by residual), alternate between fitting each line to its points
    and giving each point to the larger line; keep the best fit seen."""
    rows = np.array([[1.0, *(float(getattr(x, f)) for f, _ in FIELDS)] for x in loads])
    t = np.array(seconds, dtype=float)
    compute = _fit_line(rows, t, np.ones(len(t), dtype=bool))
    best = (_loss(rows @ compute, t), compute, np.zeros_like(compute))
    kv = rows[:, 3]
    for upper in [t > 1.2 * (rows @ compute), *(kv >= k for k in np.unique(kv))]:
        best = min(best, _alternate(rows, t, upper, best), key=lambda fit: fit[0])
    return _step_cost(best[1], best[2])


def _alternate(rows: np.ndarray, t: np.ndarray, upper: np.ndarray, best: tuple) -> tuple:
    for _ in range(20):
        if upper.sum() < 3 or (~upper).sum() < 3:
            break
        c, m = _fit_line(rows, t, ~upper), _fit_line(rows, t, upper, MEMORY_COLUMNS)
        if (loss := _loss(np.maximum(rows @ c, rows @ m), t)) < best[0]:
            best = (loss, c, m)
        if ((rows @ m > rows @ c) == upper).all():
            break
        upper = rows @ m > rows @ c
    return best


def _step_cost(compute: np.ndarray, memory: np.ndarray) -> StepCost:
    """The constant both lines share becomes the overhead (max(a + o, b + o) = o + max(a, b))."""
    overhead = min(compute[0], memory[0]) if memory.any() else compute[0]
    lines = [
        Linear(
            float(v[0] - overhead) if v.any() else 0.0,
            **{name: float(x) for (_, name), x in zip(FIELDS, v[1:], strict=True)},
        )
        for v in (compute, memory)
    ]
    return StepCost(overhead_s=float(overhead), compute=lines[0], memory=lines[1])


def relative_errors(step: StepCost, points: list[Point]) -> list[float]:
    return [(step.step_s(p.load) - p.seconds) / p.seconds for p in points]


# ---- timing the real engine ------------------------------------------------------------
def model_settings(model: str, dtype: str, device: str):
    """The engine's settings for a preset, the served default or a checkpoint's path."""
    from shared.config import ModelSettings

    if model in PRESET_NAMES:
        return ModelSettings(preset=model, dtype=dtype, device=device)
    return ModelSettings(path=None if model == SERVED_DEFAULT else model, dtype=dtype, device=device)


class Timer:
    """The engine under test plus a clock that waits for the device."""

    def __init__(self, args: argparse.Namespace, grid: Grid) -> None:
        import torch

        from shared.config import EngineSettings
        from shared.engine import LLMEngine

        torch.set_num_threads(args.threads)
        self.torch = torch
        self.cuda = args.device.startswith("cuda")
        # One CPU thread: its CPU time is the step's time on a core of its own, whatever else
        # runs on this host (the wall clock would time the neighbours too).
        self.cpu_clock = not self.cuda and args.threads == 1 and not args.wall_clock
        self.clock = time.process_time if self.cpu_clock else time.perf_counter
        b, c = max(grid.batches), max(grid.decode_contexts)
        self.step_tokens = max(*grid.chunks, *grid.batches)
        slack = decode_slack(b, c, self.step_tokens)
        longest = max(c + 1 + slack + grid.warmup + grid.repeats, max(grid.chunk_contexts) + max(grid.chunks))
        tokens = 2 * (longest + b * longest)
        kv_bytes = model_spec(args.model, args.dtype).kv_bytes_per_token
        self.engine = LLMEngine(
            model_settings(args.model, args.dtype, args.device),
            EngineSettings(
                kv_memory_mb=tokens * kv_bytes / 2**20 + 1,
                max_num_seqs=max(grid.batches),
                max_batched_tokens=self.step_tokens,
                max_model_len=longest + 64,
            ),
        )
        self.rng = random.Random(0)
        self.next_id = 0

    def with_helpers(self, threads: int, nice: int) -> None:
        """The kernels' low-priority helper threads from now on, as `pdd up` gives an engine held
        to one thread on a host it shares (pdd/launch.py). Their CPU time is the process's too:
        with them only the wall clock says what a step took."""
        from shared.config import EngineSettings
        from shared.engine.engine import share_kernel_helpers

        e = self.engine
        settings = EngineSettings(helper_threads=threads, helper_nice=nice)
        share_kernel_helpers(settings, e.linear_backend, e.runner.backend.name, e.small_ops)
        self.clock = time.perf_counter

    def timed_step(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        t0 = self.clock()
        self.engine.step()
        if self.cuda:
            self.torch.cuda.synchronize()
        return self.clock() - t0

    def add(self, tokens: list[int], max_tokens: int) -> None:
        from shared.engine import SamplingParams

        self.next_id += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(f"cal{self.next_id}", tokens, params)

    def drain(self) -> None:
        for _ in range(100_000):
            if not self.engine.has_unfinished():
                return
            self.engine.step()
        raise RuntimeError("the engine did not go idle")

    def prefix(self, context: int) -> list[int]:
        """`context` fresh tokens, computed once so later requests find them cached."""
        tokens = [self.rng.randrange(256) for _ in range(context)]
        if tokens:
            self.add(tokens, 1)
            self.drain()
        return tokens

    def decode(self, batch: int, context: int, steps: int) -> list[tuple[StepLoad, float]]:
        """`steps` pure decode steps of `batch` sequences, each after `context` tokens of its own
        (a server's requests read KV of their own: sequences sharing one prefix would read the
        same blocks `batch` times, from the CPU's caches, and time a cheaper step)."""
        rids = []
        slack = decode_slack(batch, context, self.step_tokens)
        for _ in range(batch):  # each decodes as soon as its prompt is computed: room for that
            self.add([self.rng.randrange(256) for _ in range(context + 1)], slack + steps)
            rids.append(f"cal{self.next_id}")
        sched = self.engine.scheduler
        while sched.waiting or any(s.num_tokens - s.num_computed_tokens != 1 for s in sched.running):
            self.engine.step()  # until every prompt is computed: then each decodes
        out = []
        for _ in range(steps):
            running = sched.running
            assert len(running) == batch and all(s.num_tokens - s.num_computed_tokens == 1 for s in running)
            load = decode_load(batch, sum(s.num_computed_tokens for s in running))
            out.append((load, self.timed_step()))
        for rid in rids:
            self.engine.abort(rid)
        return out

    def chunk(self, new_tokens: int, context: int, repeats: int) -> list[tuple[StepLoad, float]]:
        """`repeats` single steps, each computing `new_tokens` fresh tokens after a cached prefix."""
        prefix = self.prefix(context)
        out = []
        for _ in range(repeats):
            hits = self.engine.scheduler.num_hit_tokens
            self.add(prefix + [self.rng.randrange(256) for _ in range(new_tokens)], 1)
            seconds = self.timed_step()
            if self.engine.has_unfinished() or self.engine.scheduler.num_hit_tokens - hits != context:
                raise RuntimeError(
                    f"a chunk of {new_tokens} after {context} cached tokens took more than one step"
                )
            out.append((chunk_load(new_tokens, context), seconds))
        return out


def decode_slack(batch: int, context: int, step_tokens: int) -> int:
    """Tokens a sequence may decode while the others' prompts are still computed (steps of up
    to step_tokens tokens, the decoding sequences' own among them), before the timed steps."""
    return -(-batch * (context + 1) // max(1, step_tokens - batch)) + batch + 8


def _median_point(kind: str, size: int, context: int, timed: list[tuple[StepLoad, float]]) -> Point:
    order = sorted(timed, key=lambda lt: lt[1])
    load, seconds = order[len(order) // 2]
    return Point(kind, size, context, load, seconds)


def measure(timer: Timer, grid: Grid, advance=lambda n=1: None) -> list[Point]:
    """Every grid point, each after its own warm-up steps; the median of the repeats."""
    timer.decode(max(grid.batches), max(grid.decode_contexts), 2)  # first-call allocations
    timer.chunk(max(grid.chunks), max(grid.chunk_contexts), 2)
    points = []
    for b in grid.batches:
        for c in grid.decode_contexts:
            timed = timer.decode(b, c, grid.warmup + grid.repeats)[grid.warmup :]
            points.append(_median_point("decode", b, c, timed))
            advance()
    for n in grid.chunks:
        for c in grid.chunk_contexts:
            timed = timer.chunk(n, c, grid.warmup + grid.repeats)[grid.warmup :]
            points.append(_median_point("chunk", n, c, timed))
            advance()
    return points


# ---- the profile -------------------------------------------------------------------------
def machine(device: str) -> dict:
    import torch

    cpu = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        # `pdd up` preloads tcmalloc where it is installed (pdd/launch.py): time steps with it too
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _cpuinfo() -> list[str]:
    path = Path("/proc/cpuinfo")
    return path.read_text().splitlines() if path.exists() else []


def memory_figures(device: str) -> tuple[int, float, str, str]:
    """(memory_bytes, usable fraction, their sources): the engine's own KV sizing on this device."""
    if device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        return (
            total,
            0.9,
            "measured: torch.cuda.get_device_properties().total_memory",
            "vLLM's default gpu_memory_utilization=0.9 (https://docs.vllm.ai/en/latest/configuration/engine_args.html)",
        )
    from shared.config import EngineSettings

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (
        total,
        EngineSettings().kv_cache_space_gib * 2**30 / total,
        "measured: the host's physical memory (sysconf)",
        "the engine's default kv_cache_space_gib (vLLM's VLLM_CPU_KVCACHE_SPACE, 4 GiB) over it",
    )


def price(args: argparse.Namespace, info: dict) -> tuple[float, str]:
    if args.price is not None:
        return args.price, args.price_source or "given on the command line (--price)"
    if "gpu" not in info:
        return CPU_PRICE
    for name in ("h200-sxm", "h100-sxm", "a100-80gb", "l40s"):
        if name.split("-")[0] in info["gpu"].lower():
            return load_profile(name)[
                "price_per_hour"
            ], f"as the roofline profile {name!r} (its source there)"
    raise SystemExit(f"pdd sim calibrate: no known price for {info['gpu']!r}: pass --price USD_PER_HOUR")


def profile_json(
    args: argparse.Namespace, grid: Grid, points: list[Point], step: StepCost, clock: str
) -> dict:
    info = machine(args.device) | {"clock": clock}
    memory, usable, memory_src, usable_src = memory_figures(args.device)
    usd, usd_src = price(args, info)
    errors = relative_errors(step, points)
    where = info.get("gpu", info["cpu"])
    return {
        "kind": "calibrated",
        "description": f"{args.model} ({args.dtype}) timed on {where} by `pdd sim calibrate`",
        "model": {
            "name": args.model,
            "dtype": args.dtype,
            "device": args.device,
            "threads": info["torch_threads"],
        },
        "step": step_cost_to_json(step),
        "memory_bytes": memory,
        "usable_memory_fraction": usable,
        "price_per_hour": usd,
        "grid": asdict(grid),
        "fit": {
            "median_abs_rel_error": statistics.median(abs(e) for e in errors),
            "max_abs_rel_error": max(abs(e) for e in errors),
        },
        "points": [
            {
                "kind": p.kind,
                "size": p.size,
                "context": p.context,
                "load": asdict(p.load),
                "measured_s": p.seconds,
                "fitted_s": step.step_s(p.load),
                "rel_error": e,
            }
            for p, e in zip(points, errors, strict=True)
        ],
        "machine": info,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sources": {
            "step": f"measured here: `pdd sim calibrate` on {where}, fitted by NNLS (see points)",
            "memory_bytes": memory_src,
            "usable_memory_fraction": usable_src,
            "price_per_hour": usd_src,
        },
    }


def helper_figures(threads: int, nice: int, alone: list[Point], helped: list[Point]) -> dict:
    """What `threads` helper threads buy a step on an otherwise idle host: per grid point the
    one-thread time and the helped one (the wall clock's), their median ratio, and the helped
    steps' own fit (`step`): a helper buys a large prefill chunk more than a small decode."""
    points = [
        {
            "kind": a.kind,
            "size": a.size,
            "context": a.context,
            "one_thread_s": a.seconds,
            "helped_s": h.seconds,
        }
        for a, h in zip(alone, helped, strict=True)
    ]
    return {
        "threads": threads,
        "nice": nice,
        "clock": "wall clock (time.perf_counter)",
        "speedup": statistics.median(p["one_thread_s"] / p["helped_s"] for p in points),
        "step": step_cost_to_json(fit_step_cost([h.load for h in helped], [h.seconds for h in helped])),
        "points": points,
    }


def report(points: list[Point], step: StepCost) -> str:
    lines = [f"{'kind':<7}{'size':>6}{'context':>9}{'measured ms':>13}{'fitted ms':>11}{'error':>8}"]
    for p, e in zip(points, relative_errors(step, points), strict=True):
        lines.append(
            f"{p.kind:<7}{p.size:>6}{p.context:>9}{p.seconds * 1e3:>13.2f}{step.step_s(p.load) * 1e3:>11.2f}{e:>+8.1%}"
        )
    errors = [abs(e) for e in relative_errors(step, points)]
    lines += [
        f"fit: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}",
        f"step = {step.overhead_s * 1e3:.3f} ms + max(compute, memory)",
    ]
    for name, c in (("compute", step.compute), ("memory", step.memory)):
        lines.append(
            f"  {name:<8}{c.const * 1e3:.3f} ms + {c.per_token * 1e6:.3f} µs/token + {c.per_attn * 1e9:.3f} "
            f"ns/attn pair + {c.per_kv_read * 1e9:.3f} ns/KV token read + {c.per_seq * 1e6:.3f} µs/seq"
        )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdd sim calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="a small grid (~20 s on 2 cores with the small preset)"
    )
    ap.add_argument(
        "--model",
        "--preset",
        default="small",
        help="what to time: a preset (tiny | small | medium), default (the model `pdd up` serves) or "
        "a checkpoint's path; default: small",
    )
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16; default: float32")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N; default: cpu")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads; default: 1, as `pdd bench e2e` "
        "runs each engine (with 1 thread, steps are timed in CPU time: a busy host does not skew them)",
    )
    ap.add_argument(
        "--helper-threads",
        type=int,
        default=0,
        help="then time the grid again with this many of the kernels' low-priority helper threads "
        "(as `pdd up` runs an engine held to one thread on a shared host), by the wall clock: the "
        "profile's helpers.speedup",
    )
    ap.add_argument("--helper-nice", type=int, default=10, help="the helpers' niceness (a decoder's)")
    ap.add_argument(
        "--wall-clock", action="store_true", help="time steps by the wall clock even with 1 CPU thread"
    )
    ap.add_argument(
        "--out",
        default="cpu-calibrated",
        help="profile name; written to $PDD_SIM_PROFILES "
        "(or pdd/sim/hardware/profiles/) as NAME.json; default: cpu-calibrated",
    )
    ap.add_argument(
        "--price",
        type=float,
        default=None,
        help="USD per instance-hour; default: a 2-vCPU VM on "
        "cpu, the matching roofline profile's on a known GPU",
    )
    ap.add_argument(
        "--price-source", default=None, help="where --price comes from (written into the profile)"
    )
    add_quiet_option(ap)
    return ap.parse_args(argv)


def background_cores(host_busy_s: float, own_cpu_s: float, wall_s: float) -> float:
    """The other processes' CPU over a stretch, in cores: a neighbour on the other cores slows
    a CPU-bound step's CPU time too (shared caches and memory bandwidth), so a profile says
    what it was timed beside."""
    return max(0.0, host_busy_s - own_cpu_s) / wall_s if wall_s > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    grid = QUICK_GRID if args.quick else GPU_GRID if args.device.startswith("cuda") else DEFAULT_GRID
    timer = Timer(args, grid)
    total = len(grid.batches) * len(grid.decode_contexts) + len(grid.chunks) * len(grid.chunk_contexts)
    busy0, own0, wall0 = host_busy_s(), time.process_time(), time.monotonic()
    with progress("calibrate", total=total) as advance:
        points = measure(timer, grid, advance)
    busy, own, wall = host_busy_s() - busy0, time.process_time() - own0, time.monotonic() - wall0
    clock = "process CPU time (time.process_time)" if timer.cpu_clock else "wall clock (time.perf_counter)"
    helpers = None
    if args.helper_threads:
        timer.with_helpers(args.helper_threads, args.helper_nice)
        hbusy0, hown0, hwall0 = host_busy_s(), time.process_time(), time.monotonic()
        with progress("calibrate with helpers", total=total) as advance:
            helped = measure(timer, grid, advance)
        helpers = helper_figures(args.helper_threads, args.helper_nice, points, helped)
        print(report(helped, step_cost_from_json(helpers["step"])))
        # (the process's CPU time counts its helpers: the rest is the other processes')
        hbusy, hown, hwall = host_busy_s() - hbusy0, time.process_time() - hown0, time.monotonic() - hwall0
        helpers["background_cores"] = round(background_cores(hbusy, hown, hwall), 3)
    step = fit_step_cost([p.load for p in points], [p.seconds for p in points])
    print(report(points, step))
    profile = profile_json(args, grid, points, step, clock)
    profile["machine"]["background_cores"] = round(background_cores(busy, own, wall), 3)
    if helpers:
        profile["helpers"] = helpers
        print(
            f"with {helpers['threads']} helper thread(s): steps x{1 / helpers['speedup']:.2f} (other processes "
            f"took {helpers['background_cores']:.2f} cores meanwhile)"
        )
    print(
        f"other processes took {profile['machine']['background_cores']:.2f} cores meanwhile (a quiet host: ~0)"
    )
    out_dir = profile_dir_for_writing()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.out}.json"
    path.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0
