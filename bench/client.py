"""Client side of the end-to-end benchmarks: streaming completions timed token by token,
plus helpers to start `pdd up` systems and shape their WAN links."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from pdd.benchkit.progress import progress
from pdd.system import RunningSystem, start_system
from shared.ports import free_port
from shared.wan import WanControl

WAN_LINKS = ("bulk", "gw-ab", "gw-ba")


def start_wan(
    links: list[str], *options: str, timeout_s: float = 30.0
) -> tuple[subprocess.Popen, WanControl]:
    """A `python -m shared.wan` process with these `--link` specs; returns once it serves."""
    control = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "shared.wan", "--control", control, "--log-level", "WARNING", *options]
    for spec in links:
        args += ["--link", spec]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    wan = WanControl(f"http://{control}")
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the WAN emulator exited with code {proc.returncode}")
        try:
            httpx.get(f"http://{control}/links", timeout=1).raise_for_status()
            return proc, wan
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"the WAN emulator did not answer in {timeout_s:.0f}s") from None
            time.sleep(0.05)


@dataclass
class Timed:
    """One streamed completion as the client saw it (seconds from sending the request)."""

    status: int = 0
    error: str | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in the chunk)
    token_ids: list[int] = field(default_factory=list)
    pdd: dict = field(default_factory=dict)
    pipeline_header: str | None = None
    end: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and bool(self.chunks)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] if self.chunks else math.nan

    def time_to_token(self, k: int) -> float:
        """When the k-th output token (1-based) reached the client."""
        seen = 0
        for t, n in self.chunks:
            seen += n
            if seen >= k:
                return t
        return math.nan

    @property
    def gaps(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    @property
    def max_gap(self) -> float:
        g = self.gaps
        return max(g) if g else 0.0

    @property
    def tpot(self) -> float:
        """Time per output token after the first: (last - first) / (n - 1)."""
        if self.n_tokens < 2:
            return 0.0
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.n_tokens - 1)


def stream_completion(
    client: httpx.Client,
    prompt: list[int],
    max_tokens: int,
    *,
    pipeline: str | None = None,
    catchup_threshold: int | None = None,
    timeout: float = 300.0,
) -> Timed:
    """POST /v1/completions with stream=true, greedy, EOS ignored; times every chunk with tokens."""
    body: dict = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    opts = {
        k: v for k, v in (("pipeline", pipeline), ("catchup_threshold", catchup_threshold)) if v is not None
    }
    if opts:
        body["pdd"] = opts
    out = Timed()
    t0 = time.monotonic()
    try:
        with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
            out.status = r.status_code
            out.pipeline_header = r.headers.get("x-pdd-pipeline")
            if r.status_code != 200:
                out.error = r.read().decode(errors="replace")[:500]
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                d = json.loads(data)
                if "error" in d:
                    out.error = str(d["error"].get("message"))
                    continue
                ids = d["choices"][0].get("token_ids") or []
                if ids:
                    out.chunks.append((time.monotonic() - t0, len(ids)))
                    out.token_ids += ids
                if "pdd" in d:
                    out.pdd = d["pdd"]
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.end = time.monotonic() - t0
    return out


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def pct(xs, q: float) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(np.percentile(xs, q)) if xs else math.nan


def set_wan(
    system: RunningSystem,
    *,
    delay_ms: float,
    jitter_ms: float,
    bandwidth_mbps: float | None,
    links: tuple[str, ...] = WAN_LINKS,
) -> None:
    for link in links:
        system.wan(link, delay_ms=delay_ms, jitter_ms=jitter_ms, bandwidth_mbps=bandwidth_mbps)


def wan_counters(system: RunningSystem) -> dict:
    return httpx.get(f"{system.wan_url}/links", timeout=10).json()


def service_env(
    torch_threads: int,
    md_kv_mb: float,
    prefill_kv_mb: float,
    relay_kv_mb: float,
    prefill_chunk: int = 0,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """Environment of a benchmark deployment: KV pools sized for the workload; torch intra-op
    threads pinned (three engine processes share this host's cores); with prefill_chunk > 0,
    P computes a prompt in chunks of that many tokens (PrefillSettings.prefill_chunk), so KV
    blocks stream to MD while the rest of the prompt is still being prefilled."""
    env = {
        "PDD_MD_ENGINE__KV_MEMORY_MB": str(md_kv_mb),
        "PDD_PREFILL_ENGINE__KV_MEMORY_MB": str(prefill_kv_mb),
        "PDD_RELAY_ENGINE__KV_MEMORY_MB": str(relay_kv_mb),
        "PDD_ROUTER_TOKEN_TIMEOUT_S": "60",
    }
    if torch_threads > 0:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    if prefill_chunk > 0:
        env["PDD_PREFILL_PREFILL_CHUNK"] = str(prefill_chunk)
    env.update(extra or {})
    return env


def start_systems(specs: dict[str, dict]) -> dict[str, RunningSystem]:
    """Start several `pdd up` systems at once: {name: start_system kwargs (env, delay_ms, ...)}."""

    def one(item: tuple[str, dict]) -> tuple[str, RunningSystem]:
        name, kw = item
        workdir = Path(tempfile.mkdtemp(prefix=f"pdd-bench-{name}-"))
        return name, start_system(workdir, model_preset=kw.pop("model_preset", "small"), timeout_s=300, **kw)

    started: dict[str, RunningSystem] = {}
    with progress(f"starting {' '.join(specs)}"), ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(one, (n, dict(kw))) for n, kw in specs.items()]
        errors = []
        for f in futures:
            try:
                name, system = f.result()
                started[name] = system
            except Exception as e:  # stop whatever did start, then fail
                errors.append(e)
    if errors:
        for s in started.values():
            s.stop()
        raise errors[0]
    return {n: started[n] for n in specs}


def stop_all(systems: dict[str, RunningSystem]) -> None:
    with ThreadPoolExecutor(max(1, len(systems))) as pool:
        list(pool.map(lambda s: s.stop(), systems.values()))
