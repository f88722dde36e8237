"""compose.dc-a.yaml and compose.dc-b.yaml: each DC runs its own services from its bundle
(mounted read-only, one env file per service as `pdd certs bundle` writes them) and publishes
only what crosses the WAN (the gateway, MD's KV port) and the router."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdd.certs import DC_SERVICES, NATS_OF, NATS_PORTS

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = {"dc-a": {NATS_PORTS["dc-a"][1], 8000}, "dc-b": {NATS_PORTS["dc-b"][1], 7400}}


def load(dc: str) -> dict:
    return yaml.safe_load((ROOT / f"compose.{dc}.yaml").read_text())["services"]


def published(service: dict) -> set[int]:
    return {int(str(p).rsplit(":", 1)[-1]) for p in service.get("ports", [])}


@pytest.mark.parametrize("dc", ["dc-a", "dc-b"])
def test_each_dc_runs_its_own_services_from_its_bundle(dc):
    services = load(dc)
    assert set(services) == {NATS_OF[dc], *DC_SERVICES[dc]}
    nats = services[NATS_OF[dc]]["command"]
    assert nats[:7] == ["python", "-m", "pdd.cli", "serve", "nats", "--dc", dc]
    assert "--gateway-url" in nats and "--advertise" in nats
    for name in DC_SERVICES[dc]:
        assert services[name]["command"] == [
            "python", "-m", "pdd.cli", "serve", name, "--env-file", f"/bundle/{name}.env"
        ]  # fmt: skip
    for name, service in services.items():
        bundle = [v for v in service["volumes"] if v.endswith(":/bundle:ro")]
        assert bundle == [f"${{PDD_BUNDLE:-./bundle-{dc}}}:/bundle:ro"], name


@pytest.mark.parametrize("dc", ["dc-a", "dc-b"])
def test_only_the_wan_ports_and_the_router_are_published(dc):
    ports = set().union(*(published(s) for s in load(dc).values()))
    assert ports == PUBLISHED[dc]


def test_main_decode_advertises_the_public_address():
    env = load("dc-b")["main_decode"]["environment"]
    assert env["PDD_MD_BULK_ADDRESS"] == "tcp://0.0.0.0:7400"
    assert env["PDD_MD_ADVERTISE"].startswith("tcp://${PDD_MD_PUBLIC_HOST:?")


@pytest.mark.parametrize("dc", ["dc-a", "dc-b"])
def test_compose_accepts_the_file_with_its_variables_and_refuses_it_without(dc):
    """`docker compose config` where the compose CLI is installed (`make compose-test` installs it)."""
    cli = Path(sys.executable).parent / "docker-compose"
    if not cli.exists():
        pytest.skip("no docker-compose in the venv (make compose-test installs it)")
    site = {
        "PDD_DC_A_GATEWAY": "a.example:7222",
        "PDD_DC_B_GATEWAY": "b.example:7223",
        "PDD_MD_PUBLIC_HOST": "b.example",
    }
    argv = [str(cli), "-f", str(ROOT / f"compose.{dc}.yaml"), "config", "-q"]
    bare = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    ok = subprocess.run(argv, env={**bare, **site}, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "error" not in ok.stderr, ok.stderr
    refused = subprocess.run(argv, env=bare, capture_output=True, text=True, timeout=60)
    # (this CLI exits 0 even then, and names the first variable it misses)
    assert any(f"required variable {name} is missing" in refused.stderr for name in site), refused.stderr
