"""A real Prometheus for tests: the `prometheus` binary (Debian's package; `make install` puts it
in place through deploy/prometheus.sh) run with its own config, a temporary storage directory
and a free port, and queried through its HTTP API; `promtool` for the shipped config and rules."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from shared.ports import free_port
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "deploy/prometheus"
DASHBOARD = ROOT / "deploy/grafana/dashboards/pdd.json"
SHIPPED_CONFIG = CONFIG_DIR / "prometheus.yml"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
MISSING = (
    "no prometheus and promtool on PATH: deploy/prometheus.sh (run by `make install`) installs "
    "Debian's package `prometheus` where apt-get can"
)
SCRAPE_S = 1  # scrape and rule evaluation interval: the test waits a few of these


def dashboard_exprs(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, rows' nested panels included."""
    board = json.loads(path.read_text())
    panels = [p for top in board["panels"] for p in (top, *top.get("panels", []))]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def as_promql(expr: str, rate_interval: str = "1m") -> str:
    """A Grafana query as Prometheus takes it: its range variables given a value."""
    return re.sub(r"\$\{?__(rate_)?interval\}?", rate_interval, expr)


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL, MISSING
    return subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, cwd=CONFIG_DIR
    )


def job_of(process: str) -> str:
    """The shipped config's job for a `pdd up` process name (main_decode-1 -> main_decode)."""
    return process.split("-")[0]


def scrape_config(metrics_urls: dict[str, str], api_key: str | None = None) -> dict:
    """The shipped config, its jobs and options as they are, with each job's DNS discovery
    replaced by the given processes' metrics endpoints ({process name: URL}), the rule files
    by their absolute paths, and 1 s intervals. With router API keys, the router job sends one
    (as docs/operating.md tells a deployment to)."""
    config = copy.deepcopy(yaml.safe_load(SHIPPED_CONFIG.read_text()))
    config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
    config["rule_files"] = [str(CONFIG_DIR / name) for name in config.get("rule_files", [])]
    for job in config["scrape_configs"]:
        urls = [urlsplit(u) for name, u in metrics_urls.items() if job_of(name) == job["job_name"]]
        assert urls, f"job {job['job_name']}: no such process in {sorted(metrics_urls)}"
        assert {u.path for u in urls} == {job.get("metrics_path", "/metrics")}
        del job["dns_sd_configs"]
        job["static_configs"] = [{"targets": sorted(u.netloc for u in urls)}]
        job["scheme"] = urls[0].scheme
        if api_key and job["job_name"] == "router":
            job["authorization"] = {"credentials": api_key}
    return config


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen

    def get(self, path: str, **params: str) -> dict:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` evaluates to now (/api/v1/query)."""
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The value of a one-series `expr`, None while it has none."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None


@contextmanager
def running_prometheus(config: dict, workdir: Path, timeout_s: float = 60.0) -> Iterator[Prometheus]:
    """A Prometheus on 127.0.0.1 with `config`, ready (its /-/ready answers 200); stopped after."""
    assert PROMETHEUS, MISSING
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    check = promtool("check", "config", path)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    args = [
        PROMETHEUS,
        f"--config.file={path}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}", proc)

    def ready() -> bool:
        assert proc.poll() is None, f"prometheus exited: {(workdir / 'prometheus.log').read_text()[-2000:]}"
        try:
            return httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout_s, 0.2, what="prometheus ready")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
