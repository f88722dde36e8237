"""The measured host's CPU as the simulated engines get it.

`pdd bench e2e` records, per deployment, the wall seconds of its timed runs, the host's busy CPU
seconds and the CPU seconds of each process (bench/cpu.py). Everything that is not an engine
process (router, NATS servers, WAN emulator, supervisor, the bench's streaming clients, the idle
systems and other tenants of the host) is *background*: background cores = (host busy CPU -
engine processes' CPU) / wall seconds. Short bursts of such work wake up ahead of a CPU-bound
engine step (the kernel favours tasks that slept), so the engines share what is left:

    engine cores = cores - background cores
    step-time factor = max(1, engines a step sees busy / engine cores)

where "engines a step sees busy" comes from the simulation at full speed: per engine role its
busy fraction u_i, and, the roles taken as independent, a step of role i sees itself plus the
others' mean, so the step-weighted count is sum_i u_i (1 + U - u_i) / U with U = sum_i u_i.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ENGINE_CORES = 0.05  # a guard against dividing by ~0 (the measured engines always got more)


@dataclass(frozen=True)
class HostCpu:
    cores: float
    background_cores: float  # the non-engine work's CPU rate over the run (CPU s per wall s)

    @property
    def engine_cores(self) -> float:
        return max(MIN_ENGINE_CORES, self.cores - self.background_cores)

    def factor(self, engines_busy: float) -> float:
        """Step-time factor for engines that see `engines_busy` engines computing (themselves included)."""
        return max(1.0, engines_busy / self.engine_cores)


def from_account(account: dict, cores: float) -> HostCpu:
    """From one deployment's bench/cpu.py account: background = (host busy - engines) / wall."""
    background = (account["host_busy_s"] - account["engines_s"]) / account["wall_s"] if account["wall_s"] > 0 else 0.0
    return HostCpu(cores, max(0.0, background))


def engines_seen_busy(busy_s: dict[str, float], span_s: float) -> float:
    """Engines computing at once as a step sees it (itself included): per role busy fraction u,
    roles independent: sum u_i (1 + U - u_i) / U. 0 when nothing computed."""
    if span_s <= 0:
        return 0.0
    u = [b / span_s for b in busy_s.values() if b > 0]
    total = sum(u)
    return sum(x * (1 + total - x) for x in u) / total if total > 0 else 0.0
