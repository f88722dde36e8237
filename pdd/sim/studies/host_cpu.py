"""The measured host's CPU as the simulated engines get it.

`pdd bench e2e` records, per deployment, the wall seconds of its timed runs, the host's busy CPU
seconds and the CPU seconds of each process (pdd/benchkit/cpu.py). Everything that is not an engine
process (router, NATS servers, WAN emulator, supervisor, the bench's streaming clients, the idle
systems and other tenants of the host) is *background*: background cores = (host busy CPU -
engine processes' CPU) / wall seconds. Short bursts of such work wake up ahead of a CPU-bound
engine step (the kernel favours tasks that slept), so the engines share what is left:

    engine cores = cores - background cores
    cores a busy engine gets = engine cores / engines a step sees busy
    its step time: on those cores (below)

An engine held to one torch thread computes on one core at the calibrated (one-thread) speed;
fewer cores slow it in proportion. `pdd up` also gives it low-priority helper threads that take
a core nobody else wants (shared/model/kernels/helpers.h), so on more than one core it is
faster, up to its calibrated helped steps on two (`pdd sim calibrate --helper-threads`: a
helper buys a large prefill chunk ~1.8x, a one-sequence decode step ~1.2x). In between, the
helper finds the second core for the share of the time it is free, and the step is that much
of the way from one thread's time to the helped time:

    step = one-thread step / cores                                  (at most one core)
    step = one-thread step + min(cores - 1, 1) * (helped - one-thread)   (more)

where "engines a step sees busy" comes from the simulation at full speed: when each engine
computed (its steps), and, weighted by computing time, how many engines computed at that
moment (itself included). Taken from the simulated timeline, not from busy fractions as if
the engines were independent: a prefill that runs while the decoder waits for its KV (one
request P→MD) shares the cores with no other engine, whatever the decoder's share of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdd.sim.hardware.step_cost import Linear, StepCost

MIN_ENGINE_CORES = 0.05  # a guard against dividing by ~0 (the measured engines always got more)


@dataclass(frozen=True)
class HostCpu:
    cores: float
    background_cores: float  # the non-engine work's CPU rate over the run (CPU s per wall s)
    helped: StepCost | None = None  # a step alone on an idle host, its helpers on a second core (calibrated)

    @property
    def engine_cores(self) -> float:
        return max(MIN_ENGINE_CORES, self.cores - self.background_cores)

    def cores_each(self, engines_busy: float) -> float:
        """The cores a busy engine gets when a step sees `engines_busy` engines computing."""
        return self.engine_cores / engines_busy if engines_busy > 0 else self.cores

    def step(self, one_thread: StepCost, engines_busy: float) -> StepCost:
        """An engine's steps on this host when it sees `engines_busy` engines computing
        (themselves included)."""
        cores = self.cores_each(engines_busy)
        if cores <= 1.0:
            return scaled(one_thread, 1.0 / cores)
        if self.helped is None:
            return one_thread
        return blend(one_thread, self.helped, min(cores - 1.0, 1.0))

    def helper_core(self, engines_busy: float) -> float:
        """The share of a second core its helpers get (0 without helpers or past one engine a core)."""
        return min(max(self.cores_each(engines_busy) - 1.0, 0.0), 1.0) if self.helped else 0.0


def scaled(step: StepCost, factor: float) -> StepCost:
    """Every term `factor` times as long."""
    return blend(step, step, 0.0, factor)


def blend(a: StepCost, b: StepCost, w: float, factor: float = 1.0) -> StepCost:
    """factor x ((1 - w) a + w b), term by term (exact where a step's larger term is the same
    in both)."""

    def mix(x: float, y: float) -> float:
        return factor * ((1.0 - w) * x + w * y)

    def line(x: Linear, y: Linear) -> Linear:
        return Linear(*(mix(getattr(x, f), getattr(y, f)) for f in LINEAR_FIELDS))

    return replace(
        a,
        overhead_s=mix(a.overhead_s, b.overhead_s),
        compute=line(a.compute, b.compute),
        memory=line(a.memory, b.memory),
    )


LINEAR_FIELDS = ("const", "per_token", "per_attn", "per_kv_read", "per_seq")


def from_account(account: dict, cores: float, helped: StepCost | None = None) -> HostCpu:
    """From one deployment's pdd/benchkit/cpu.py account: background = (host busy - engines) / wall."""
    background = (
        (account["host_busy_s"] - account["engines_s"]) / account["wall_s"] if account["wall_s"] > 0 else 0.0
    )
    return HostCpu(cores, max(0.0, background), helped)


def engines_seen_busy(spells: list[list[tuple[float, float]]]) -> float:
    """Engines computing at once as a step sees it (itself included), from each engine's busy
    spells (start, end): the mean over computing time of how many engines compute then. 0 when
    nothing computed."""
    edges = sorted((t, d) for engine in spells for a, b in engine if b > a for t, d in ((a, 1), (b, -1)))
    n, last, seen, busy = 0, 0.0, 0.0, 0.0
    for t, d in edges:
        seen += n * n * (t - last)  # n engines computing, each seeing n
        busy += n * (t - last)
        n, last = n + d, t
    return seen / busy if busy > 0 else 0.0
