"""compose.yaml under a real Docker engine, checked from the host as a user would (the last
step of `make compose-test`, deploy/compose-test.sh):

1. the reference: the same requests through `pdd up` on this host (greedy, and seeded);
2. `docker compose up`: the certs init, both NATS servers, the WAN emulator, prefill, relay,
   main decode and router come up healthy; then /health, completions equal to `pdd up`'s,
   a streamed chat equal to `pdd up`'s, the `x-pdd-pipeline` header of both pipelines, one
   request's spans from both datacenters (/v1/traces/{id}), the router's /metrics;
3. `--scale main_decode=2`: the second MD joins and both serve requests, still exact; with the
   profile `monitoring` on, Prometheus scrapes every replica and Grafana serves the dashboard;
4. `docker compose down -v`: no container, network or volume of the project is left.

Every wait is bounded. On a failure the containers' last log lines are printed.

    python deploy/compose_check.py --compose .venv/bin/docker-compose
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdd.system import start_system  # noqa: E402

PROJECT = "pdd"  # compose.yaml's `name`
URL = "http://127.0.0.1:8000"  # the router's published port
PROMETHEUS = "http://127.0.0.1:9090"  # profile `monitoring`
GRAFANA = "http://127.0.0.1:3000"
DASHBOARD_UID = "pdd-overview"  # deploy/grafana/dashboards/pdd.json
PRESET = "tiny"  # compose's default PDD_MODEL_PRESET
UP_TIMEOUT_S = 300
HTTP_TIMEOUT_S = 120
SCALED_REQUESTS = 16  # distinct prompts sent until both MDs have served one


def prompt_of(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt * 13 + 3) % 250 for i in range(n)]


# What is sent to `pdd up` and to compose alike: name -> (path, body).
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "greedy": (
        "/v1/completions",
        {
            "prompt": prompt_of(70, 1),
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "pdd": {"pipeline": "p-md"},
        },
    ),
    "seeded": (
        "/v1/completions",
        {
            "prompt": prompt_of(90, 2),
            "max_tokens": 32,
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 1234,
            "ignore_eos": True,
        },
    ),
    "relay": (
        "/v1/completions",
        {
            "prompt": prompt_of(600, 3),
            "max_tokens": 500,
            "temperature": 0,
            "ignore_eos": True,
            "pdd": {"pipeline": "p-rld-md", "catchup_threshold": 10_000},
        },
    ),
    "chat": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Two datacenters, one answer."}],
            "max_tokens": 20,
            "temperature": 0,
            "stream": True,
        },
    ),
    **{
        f"scaled-{i}": (
            "/v1/completions",
            {
                "prompt": prompt_of(40 + i, 10 + i),
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "pdd": {"pipeline": "p-md"},
            },
        )
        for i in range(SCALED_REQUESTS)
    },
}


class CheckFailed(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)
    print(f"  ok: {what}")


def send(url: str, name: str) -> tuple[httpx.Response, Any]:
    """One request of REQUESTS: (response, its result: token ids, or a stream's text)."""
    path, body = REQUESTS[name]
    model = httpx.get(f"{url}/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]["id"]
    r = httpx.post(f"{url}{path}", json={"model": model, **body}, timeout=HTTP_TIMEOUT_S)
    if r.status_code != 200:
        raise CheckFailed(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
    if body.get("stream"):
        return r, _streamed_text(r.text)
    return r, r.json()["choices"][0]["token_ids"]


def _streamed_text(sse: str) -> str:
    lines = [ln.removeprefix("data: ") for ln in sse.splitlines() if ln.startswith("data: ")]
    if not lines or lines[-1] != "[DONE]":
        raise CheckFailed(f"stream did not end with [DONE]: {sse[-300:]}")
    chunks = [json.loads(ln) for ln in lines[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def reference() -> dict[str, Any]:
    """Every request's result through `pdd up` on this host."""
    with tempfile.TemporaryDirectory(prefix="pdd-compose-ref-") as workdir:
        t0 = time.monotonic()
        system = start_system(Path(workdir), model_preset=PRESET)
        try:
            results = {name: send(system.router_url, name)[1] for name in REQUESTS}
        finally:
            system.stop()
    print(f"reference: {len(results)} requests through `pdd up` ({time.monotonic() - t0:.0f} s)")
    return results


class Compose:
    def __init__(self, binary: str) -> None:
        self.argv = [binary, "-f", str(ROOT / "compose.yaml"), "-p", PROJECT]

    def __call__(self, *args: str, timeout: float = UP_TIMEOUT_S, check: bool = True) -> str:
        t0 = time.monotonic()
        done = subprocess.run([*self.argv, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise CheckFailed(
                f"docker compose {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
            )
        print(f"docker compose {' '.join(args)}: {time.monotonic() - t0:.1f} s")
        return done.stdout

    def up(self, *args: str) -> None:
        self(
            "up",
            "-d",
            "--no-build",
            "--wait",
            "--wait-timeout",
            str(UP_TIMEOUT_S),
            *args,
            timeout=UP_TIMEOUT_S + 60,
        )


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 60) -> Any:
    """probe() until it returns something true (exceptions count as not yet)."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            if got := probe():
                return got
        except (httpx.HTTPError, KeyError, ValueError) as e:
            last = e
        time.sleep(0.5)
    raise CheckFailed(f"{what}: not within {timeout_s:g} s (last error: {last})")


def health(roles: dict[str, int]) -> Callable[[], bool]:
    def probe() -> bool:
        r = httpx.get(f"{URL}/health", timeout=5)
        return r.status_code == 200 and r.json()["instances"] == roles

    return probe


def check_single(want: dict[str, Any]) -> None:
    wait_for("/health with one instance of each role", health({"prefill": 1, "relay": 1, "main_decode": 1}))
    check(True, "/health: prefill, relay and main decode registered")
    r, tokens = send(URL, "greedy")
    check(tokens == want["greedy"], "greedy completion equal to `pdd up`'s")
    check(r.headers["x-pdd-pipeline"] == "p-md", "x-pdd-pipeline: p-md")
    trace_id = r.json()["pdd"]["trace_id"]
    _, tokens = send(URL, "seeded")
    check(tokens == want["seeded"], "seeded sampled completion equal to `pdd up`'s")
    r, tokens = send(URL, "relay")
    stats = r.json()["pdd"]
    check(
        r.headers["x-pdd-pipeline"] == "p-rld-md" and stats["rld_tokens"] > 0 and stats["md_tokens"] > 0,
        f"x-pdd-pipeline: p-rld-md (relay {stats['rld_tokens']} tokens, then MD {stats['md_tokens']})",
    )
    check(tokens == want["relay"], "P→RLD→MD completion equal to `pdd up`'s")
    _, text = send(URL, "chat")
    check(bool(text) and text == want["chat"], f"streamed chat equal to `pdd up`'s ({len(text)} characters)")

    def trace() -> dict[str, Any] | None:
        r = httpx.get(f"{URL}/v1/traces/{trace_id}", timeout=10)
        body = r.json() if r.status_code == 200 else {}
        return body if {"dc-a", "dc-b"} <= set(body.get("datacenters", [])) else None

    spans = wait_for("one request's spans from both datacenters", trace, 30)
    check(True, f"/v1/traces/{trace_id}: {len(spans['spans'])} spans from {', '.join(spans['services'])}")
    metrics = httpx.get(f"{URL}/metrics", timeout=10).text
    served = [ln for ln in metrics.splitlines() if ln.startswith("pdd_requests_total{")]
    check(
        any('pipeline="p-md"' in ln for ln in served) and any('pipeline="p-rld-md"' in ln for ln in served),
        "/metrics: pdd_requests_total by pipeline",
    )


def check_scaled(compose: Compose, want: dict[str, Any]) -> None:
    compose.up("--no-recreate", "--scale", "main_decode=2")
    wait_for("/health with two main decoders", health({"prefill": 1, "relay": 1, "main_decode": 2}))
    check(True, "/health: the second main decoder joined")
    served: dict[str, int] = {}
    for i in range(SCALED_REQUESTS):
        r, tokens = send(URL, f"scaled-{i}")
        if tokens != want[f"scaled-{i}"]:
            raise CheckFailed(f"scaled-{i}: tokens differ from `pdd up`'s")
        md = r.json()["pdd"]["instances"]["main_decode"]
        served[md] = served.get(md, 0) + 1
        if len(served) == 2:
            break
    check(len(served) == 2, f"both main decoders served, tokens equal to `pdd up`'s: {served}")


def check_monitoring() -> None:
    """Profile `monitoring`: Prometheus scrapes every replica (both MDs after the scale-up, found
    through Docker's DNS) and evaluates its rules, Grafana shows the provisioned dashboard and
    queries Prometheus."""
    replicas = {"prefill": 1, "relay": 1, "main_decode": 2, "router": 1}

    def targets_up() -> bool:
        active = httpx.get(f"{PROMETHEUS}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        up = [t["labels"]["job"] for t in active if t["health"] == "up"]
        return all(up.count(job) == n for job, n in replicas.items())

    wait_for("Prometheus scraping every replica", targets_up, 90)
    check(True, f"Prometheus: every replica scraped {replicas}")

    def rules_evaluated() -> bool:  # deploy/prometheus/rules.yml, mounted beside the config
        groups = httpx.get(f"{PROMETHEUS}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return bool(rules) and all(r["health"] == "ok" for r in rules)

    wait_for("Prometheus evaluating its recording rules and alerts", rules_evaluated, 60)
    check(True, "Prometheus: its recording rules and alerts evaluate")
    board = httpx.get(f"{GRAFANA}/api/dashboards/uid/{DASHBOARD_UID}", timeout=10)  # anonymous viewer
    check(
        board.status_code == 200 and bool(board.json()["dashboard"]["panels"]), "Grafana: the pdd dashboard"
    )

    def grafana_query() -> bool:
        query = {
            "refId": "A",
            "datasource": {"type": "prometheus", "uid": "pdd-prometheus"},
            "expr": "sum(pdd_requests_total)",
            "instant": True,
            "range": False,
        }
        r = httpx.post(
            f"{GRAFANA}/api/ds/query", json={"queries": [query], "from": "now-5m", "to": "now"}, timeout=10
        )
        return r.status_code == 200 and bool(r.json()["results"]["A"].get("frames"))

    wait_for("Grafana querying Prometheus", grafana_query, 60)
    check(True, "Grafana: its datasource answers a dashboard query")


def leftovers() -> list[str]:
    """The project's containers, networks and volumes still on the engine."""
    label = f"label=com.docker.compose.project={PROJECT}"
    out = []
    for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
        listed = subprocess.run(
            ["docker", *kind, "-q", "--filter", label], capture_output=True, text=True, timeout=60
        )
        out += [f"{kind[0]} {x}" for x in listed.stdout.split()]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compose", default="docker-compose", help="the docker-compose binary")
    args = parser.parse_args()
    compose = Compose(args.compose)
    failed = None
    want = reference()
    compose("down", "-v", "--remove-orphans")  # what an interrupted earlier run left
    try:
        compose.up()
        check_single(want)
        check_scaled(compose, want)
        if "monitoring" in os.environ.get("COMPOSE_PROFILES", "").split(","):
            check_monitoring()
    except (CheckFailed, subprocess.TimeoutExpired) as e:
        failed = e
        print(compose("logs", "--no-color", "--tail", "40", check=False), file=sys.stderr)
    finally:
        compose("down", "-v", "--remove-orphans", check=failed is None)
    left = leftovers()
    if failed is None:
        check(not left, "docker compose down -v: no container, network or volume left")
        return 0
    print(f"FAILED: {failed}" + (f"\nleft behind: {left}" if left else ""), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
