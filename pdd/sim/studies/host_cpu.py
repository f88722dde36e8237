"""The measured host's CPU as the simulated engines get it.

`pdd bench e2e` records, per deployment, the wall seconds of its timed runs, the host's busy CPU
seconds and the CPU seconds of each process (pdd/benchkit/cpu.py). Everything that is not an engine
process (router, NATS servers, WAN emulator, supervisor, the bench's streaming clients, the idle
systems and other tenants of the host) is *background*: background cores = (host busy CPU -
engine processes' CPU) / wall seconds. Short bursts of such work wake up ahead of a CPU-bound
engine step (the kernel favours tasks that slept), so the engines share what is left:

    engine cores = cores - background cores
    cores a busy engine gets = engine cores / engines a step sees busy
    step-time factor = 1 / its speed on them

An engine held to one torch thread computes on one core at the calibrated (one-thread) speed;
fewer cores slow it in proportion. `pdd up` also gives it low-priority helper threads that take
a core nobody else wants (shared/model/kernels/helpers.h), so on more than one core it is
faster, up to the calibrated helper speedup on two: in between, the helper finds the second
core for the share of the time it is free, and the step goes that much faster then:

    speed = cores          (at most one core)
    speed = 1 + (helper speedup - 1) * min(cores - 1, 1)   (more)

where "engines a step sees busy" comes from the simulation at full speed: when each engine
computed (its steps), and, weighted by computing time, how many engines computed at that
moment (itself included). Taken from the simulated timeline, not from busy fractions as if
the engines were independent: a prefill that runs while the decoder waits for its KV (one
request P→MD) shares the cores with no other engine, whatever the decoder's share of the run.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ENGINE_CORES = 0.05  # a guard against dividing by ~0 (the measured engines always got more)


@dataclass(frozen=True)
class HostCpu:
    cores: float
    background_cores: float  # the non-engine work's CPU rate over the run (CPU s per wall s)
    helper_speedup: float = 1.0  # a step alone on an idle host, its helpers on a second core (calibrated)

    @property
    def engine_cores(self) -> float:
        return max(MIN_ENGINE_CORES, self.cores - self.background_cores)

    def factor(self, engines_busy: float) -> float:
        """Step-time factor for engines that see `engines_busy` engines computing (themselves included)."""
        cores = self.engine_cores / engines_busy if engines_busy > 0 else self.cores
        if cores <= 1.0:
            return 1.0 / cores
        return 1.0 / (1.0 + (self.helper_speedup - 1.0) * min(cores - 1.0, 1.0))


def from_account(account: dict, cores: float, helper_speedup: float = 1.0) -> HostCpu:
    """From one deployment's pdd/benchkit/cpu.py account: background = (host busy - engines) / wall."""
    background = (
        (account["host_busy_s"] - account["engines_s"]) / account["wall_s"] if account["wall_s"] > 0 else 0.0
    )
    return HostCpu(cores, max(0.0, background), helper_speedup)


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
