"""compose.yaml runs what `pdd up` runs (shared/launch.py), only with container hostnames.

There is no Docker engine here, so this checks the file's structure and compares every
container's command and environment with service_specs(opts, COMPOSE_HOSTS).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.launch import COMPOSE_HOSTS, SERVICES, UpOptions, nats_specs, service_specs

ROOT = Path(__file__).resolve().parents[1]
OTLP = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}


def _defaults(value: Any) -> Any:
    """Resolve compose's `${VAR:-default}` interpolation to the default, recursively."""
    if isinstance(value, str):
        return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [_defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: _defaults(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _defaults(yaml.safe_load((ROOT / "compose.yaml").read_text()))


@pytest.fixture(scope="module")
def specs() -> dict[str, Any]:
    return {s.name: s for s in service_specs(UpOptions(), COMPOSE_HOSTS)}


def test_services_present(compose: dict[str, Any]) -> None:
    expected = {"nats-a", "nats-b", "wan", *SERVICES, "jaeger"}
    assert set(compose["services"]) == expected


@pytest.mark.parametrize("name", ["wan", *SERVICES])
def test_command_and_env_match_pdd_up(compose: dict[str, Any], specs: dict[str, Any], name: str) -> None:
    svc, spec = compose["services"][name], specs[name]
    assert svc["command"] == ["python", *spec.argv[1:]]  # same module, same flags, same links
    env = {k: str(v) for k, v in svc["environment"].items()}
    assert env == {**spec.env, **({} if name == "wan" else OTLP)}
    assert svc["build"] == "." and svc["image"] == "pdd:latest"


@pytest.mark.parametrize("name", ["nats-a", "nats-b", "wan", *SERVICES])
def test_healthchecks(compose: dict[str, Any], specs: dict[str, Any], name: str) -> None:
    test = " ".join(compose["services"][name]["healthcheck"]["test"])
    env = specs[name].env if name in specs else {}
    port = next((v for k, v in env.items() if k.endswith("_METRICS_PORT")), None)
    if name == "router":
        assert f"localhost:{UpOptions().router_port}/health" in test
    elif port:
        assert f"localhost:{port}/metrics" in test
    elif name == "wan":
        assert str(UpOptions().wan_control_port) in test
    else:
        assert "8222/healthz" in test


def test_depends_on(compose: dict[str, Any], specs: dict[str, Any]) -> None:
    services = compose["services"]
    for name in SERVICES:
        deps = services[name]["depends_on"]
        nats_host = re.match(
            r"nats://([^:]+):", next(v for k, v in specs[name].env.items() if k.endswith("_NATS_URL"))
        )
        assert deps[nats_host.group(1)]["condition"] == "service_healthy"
        assert "jaeger" in deps
    assert {
        k for k, v in services["router"]["depends_on"].items() if v["condition"] == "service_healthy"
    } >= {
        "prefill",
        "relay",
        "main_decode",
    }
    assert {"wan", "relay"} <= set(services["prefill"]["depends_on"])


def test_ports_and_jaeger(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert f"{UpOptions().router_port}:{UpOptions().router_port}" in services["router"]["ports"]
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one")
    assert str(jaeger["environment"]["COLLECTOR_OTLP_ENABLED"]).lower() == "true"
    assert {"16686:16686", "4318:4318"} <= set(jaeger["ports"])


def test_relay_socket_is_shared(compose: dict[str, Any], specs: dict[str, Any]) -> None:
    sock = specs["relay"].env["PDD_RELAY_LOCAL_ADDRESS"].removeprefix("unix://")
    for name in ("prefill", "relay"):
        mounts = dict(v.split(":", 1)[::-1] for v in compose["services"][name]["volumes"])
        assert mounts.get(str(Path(sock).parent)) in compose["volumes"]


def test_nats_gateways_cross_the_wan(compose: dict[str, Any]) -> None:
    for spec in nats_specs(UpOptions(), COMPOSE_HOSTS):
        svc = compose["services"][spec.name]
        assert svc["image"].startswith("nats:")
        (mount,) = svc["configs"]
        assert mount["target"] in svc["command"]
        conf = json.loads(compose["configs"][mount["source"]]["content"])
        assert conf["port"] == spec.port
        gw = conf["gateway"]
        assert (gw["name"], gw["port"], gw["advertise"]) == (spec.name, spec.gateway_port, spec.advertise)
        assert {g["name"]: g["url"] for g in gw["gateways"]} == spec.gateways
        assert all(url.startswith(f"nats://{COMPOSE_HOSTS.wan}:") for url in spec.gateways.values())


def test_dockerfile_installs_cpu_torch_first() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    torch = text.index("torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    assert torch < text.index("pip install .")
