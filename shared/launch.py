"""The one description of which processes make up the two-DC system.

`pdd up` runs these specs on one machine; tests/test_compose.py checks that every container
in compose.yaml runs the same command with the same environment (only the addresses in
`Hosts` differ), so the two cannot drift apart.

Topology (DESIGN.md): nats-a (dc-a) and nats-b (dc-b) joined by a NATS gateway whose two
connections cross the WAN emulator (links gw-ab, gw-ba); KV bulk P -> MD crosses link `bulk`.
prefill, relay, router live in dc-a on nats-a; main_decode in dc-b on nats-b.

Security is always on: every NATS connection and the gateway run mutual TLS, and each service
connects as its own NATS user. The credentials live in one secrets directory
(shared/security/credentials.py); services get the paths of their files in their settings.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shared.security.credentials import Credentials

DC_A = "dc-a"
DC_B = "dc-b"
SERVICES = ("prefill", "relay", "main_decode", "router")
KV_SERVICES = ("prefill", "relay", "main_decode")  # ends of the KV bulk channel: they hold its secret
# Env prefix of each service's settings class in shared/config.py.
ENV_PREFIX = {
    "prefill": "PDD_PREFILL_",
    "relay": "PDD_RELAY_",
    "main_decode": "PDD_MD_",
    "router": "PDD_ROUTER_",
}


@dataclass
class UpOptions:
    """Flags of `pdd up`."""

    host: str = "127.0.0.1"
    router_port: int = 8000
    delay_ms: float = 15.0  # one-way WAN delay
    jitter_ms: float = 2.0
    bandwidth_mbps: float = 1000.0
    model_preset: str = "tiny"
    model_path: str | None = None
    workdir: Path = Path(".pdd")
    nats_a_port: int = 4222
    nats_b_port: int = 4223
    gw_a_port: int = 7222
    gw_b_port: int = 7223
    wan_gw_ab_port: int = 7322
    wan_gw_ba_port: int = 7323
    md_bulk_port: int = 7400
    wan_bulk_port: int = 7401
    wan_control_port: int = 7490
    metrics_base_port: int = 9100
    api_keys: tuple[str, ...] = ()  # router API keys (`--api-key`, repeatable); none: the API is open


# `--base-port N`: every port of the system in one block N..N+19 (tests run several systems).
PORT_OFFSETS = {
    "router_port": 0,
    "nats_a_port": 1,
    "nats_b_port": 2,
    "gw_a_port": 3,
    "gw_b_port": 4,
    "wan_gw_ab_port": 5,
    "wan_gw_ba_port": 6,
    "md_bulk_port": 7,
    "wan_bulk_port": 8,
    "metrics_base_port": 10,  # services use +1..+3
    "wan_control_port": 19,
}


def with_base_port(opts: UpOptions, base: int) -> UpOptions:
    return dataclasses.replace(opts, **{name: base + off for name, off in PORT_OFFSETS.items()})


MD_BULK_PORTS = 10  # on one machine, main decoder i listens on md_bulk_port + i


@dataclass(frozen=True)
class Hosts:
    """What differs between one machine (`pdd up`) and one container per process (compose)."""

    bind: str  # address listeners bind to
    nats_a: str
    nats_b: str
    wan: str
    main_decode: str  # host of the main decoders' bulk listeners; "*": any (link `bulk` dials on demand)
    socket_dir: str | None = None  # relay's unix socket directory; None = the workdir
    secrets_dir: str | None = None  # credentials (shared/security/credentials.py); None = <workdir>/secrets
    local_traces: bool = True  # set PDD_TRACE_DIR (compose exports OTLP to Jaeger instead)

    @classmethod
    def local(cls, host: str) -> Hosts:
        return cls(bind=host, nats_a=host, nats_b=host, wan=host, main_decode=host)


COMPOSE_WORKDIR = "/pdd"  # a volume: the certs service writes the credentials, the rest read them
# Compose service names double as hostnames; the relay socket lives on a shared volume.
COMPOSE_HOSTS = Hosts(
    bind="0.0.0.0",
    nats_a="nats-a",
    nats_b="nats-b",
    wan="wan",
    main_decode="*",  # replicas (`--scale main_decode=N`) have addresses unknown in advance
    socket_dir="/run/pdd",
    secrets_dir=f"{COMPOSE_WORKDIR}/secrets",
    local_traces=False,
)


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    datacenter: str


@dataclass
class LinkSpec:
    """One emulated WAN direction: listen on `listen_port`, forward to `target`. With
    `last_port`, dial on demand (shared/wan/via.py): to the host:port each client names, on
    target_host ("*" = any host) and a port in target_port..last_port."""

    name: str
    listen_port: int
    target_host: str
    target_port: int
    last_port: int | None = None

    @property
    def target(self) -> str:
        if self.last_port is None or (self.target_host == "*" and self.last_port == self.target_port):
            return f"{self.target_host}:{self.target_port}"
        return f"{self.target_host}:{self.target_port}-{self.last_port}"


@dataclass
class NatsSpec:
    """One NATS server of the supercluster; `gateways` maps remote gateway name -> URL (via the WAN)."""

    name: str  # also its gateway name
    datacenter: str
    port: int
    gateway_port: int
    gateways: dict[str, str] = field(default_factory=dict)
    advertise: str | None = None  # gateway address peers should use (the WAN link in front of it)


def secrets_dir(opts: UpOptions, hosts: Hosts | None = None) -> Path:
    h = hosts or Hosts.local(opts.host)
    return Path(h.secrets_dir) if h.secrets_dir else opts.workdir.resolve() / "secrets"


def certs_spec() -> ProcessSpec:
    """Compose's one-shot init: create the credentials and the NATS configs unless present."""
    argv = [sys.executable, "-m", "shared.cli", "certs", "--keep", "--compose", "--workdir", COMPOSE_WORKDIR]
    return ProcessSpec("certs", argv, {"PYTHONUNBUFFERED": "1"}, DC_A)


def wan_links(opts: UpOptions, hosts: Hosts | None = None) -> list[LinkSpec]:
    """Link `bulk` dials on demand, so one emulated line reaches every main decoder: on one
    machine they share a host on ports md_bulk_port.., in compose a port on hosts unknown here."""
    h = hosts or Hosts.local(opts.host)
    last_md_port = opts.md_bulk_port + (0 if h.main_decode == "*" else MD_BULK_PORTS - 1)
    return [
        LinkSpec("gw-ab", opts.wan_gw_ab_port, h.nats_b, opts.gw_b_port),
        LinkSpec("gw-ba", opts.wan_gw_ba_port, h.nats_a, opts.gw_a_port),
        LinkSpec("bulk", opts.wan_bulk_port, h.main_decode, opts.md_bulk_port, last_md_port),
    ]


def nats_specs(opts: UpOptions, hosts: Hosts | None = None) -> list[NatsSpec]:
    """nats-a dials nats-b's gateway through link gw-ab, nats-b dials nats-a through gw-ba.

    Each also advertises the WAN address in front of it, so gateway gossip never teaches a
    peer a direct address that would bypass the emulator.
    """
    h = hosts or Hosts.local(opts.host)
    ab = f"{h.wan}:{opts.wan_gw_ab_port}"
    ba = f"{h.wan}:{opts.wan_gw_ba_port}"
    return [
        NatsSpec("nats-a", DC_A, opts.nats_a_port, opts.gw_a_port, {"nats-b": f"nats://{ab}"}, advertise=ba),
        NatsSpec("nats-b", DC_B, opts.nats_b_port, opts.gw_b_port, {"nats-a": f"nats://{ba}"}, advertise=ab),
    ]


def wan_spec(opts: UpOptions, hosts: Hosts | None = None) -> ProcessSpec:
    """`python -m shared.wan`: every link in one emulator process, plus its HTTP control API."""
    h = hosts or Hosts.local(opts.host)
    argv = [sys.executable, "-m", "shared.wan", "--control", f"{h.bind}:{opts.wan_control_port}"]
    argv += ["--delay-ms", str(opts.delay_ms), "--jitter-ms", str(opts.jitter_ms)]
    argv += ["--bandwidth-mbps", str(opts.bandwidth_mbps)]
    for link in wan_links(opts, h):
        argv += ["--link", f"{link.name}={h.bind}:{link.listen_port}>{link.target}"]
    return ProcessSpec("wan", argv, {"PYTHONUNBUFFERED": "1"}, DC_A)


def _service_env(
    name: str, opts: UpOptions, h: Hosts, nats_url: str, dc: str, metrics: int | None
) -> dict[str, str]:
    p = ENV_PREFIX[name]
    env = {
        "PYTHONUNBUFFERED": "1",
        f"{p}NATS_URL": nats_url,
        f"{p}INSTANCE": "0",
        f"{p}DATACENTER": dc,
        f"{p}MODEL__PRESET": opts.model_preset,
        **_credentials_env(name, secrets_dir(opts, h)),
    }
    if opts.model_path:
        env[f"{p}MODEL__PATH"] = str(opts.model_path)
    if metrics is not None:
        env[f"{p}METRICS_PORT"] = str(metrics)
        env[f"{p}METRICS_HOST"] = h.bind  # like the service: loopback under `pdd up`
    if h.local_traces:
        env["PDD_TRACE_DIR"] = str(opts.workdir.resolve() / "traces")
    return env


def _credentials_env(name: str, directory: Path) -> dict[str, str]:
    """The paths of this service's own credentials; never the secrets themselves."""
    creds, p = Credentials(directory), ENV_PREFIX[name]
    ident = creds.identity(name)
    env = {
        f"{p}NATS_USER": name,
        f"{p}NATS_PASSWORD_FILE": str(creds.password_file(name)),
        f"{p}TLS_CA": str(ident.ca),
        f"{p}TLS_CERT": str(ident.cert),
        f"{p}TLS_KEY": str(ident.key),
    }
    if name in KV_SERVICES:
        env[f"{p}SECRET_FILE"] = str(creds.secret_file)
    return env


def service_specs(opts: UpOptions, hosts: Hosts | None = None) -> list[ProcessSpec]:
    """wan, prefill, relay, main_decode, router — in start order (router last: it is the health gate)."""
    h = hosts or Hosts.local(opts.host)
    nats_a = f"tls://{h.nats_a}:{opts.nats_a_port}"
    nats_b = f"tls://{h.nats_b}:{opts.nats_b_port}"
    sock_dir = h.socket_dir or str(opts.workdir.resolve())
    m = opts.metrics_base_port

    def svc(name: str, nats_url: str, dc: str, metrics: int | None, **extra: str) -> ProcessSpec:
        env = _service_env(name, opts, h, nats_url, dc, metrics)
        env.update({ENV_PREFIX[name] + k.upper(): v for k, v in extra.items()})
        return ProcessSpec(name, [sys.executable, "-m", f"services.{name}"], env, dc)

    return [
        wan_spec(opts, h),
        svc("prefill", nats_a, DC_A, m + 1, bulk_via=f"tcp://{h.wan}:{opts.wan_bulk_port}"),
        svc("relay", nats_a, DC_A, m + 2, local_address=f"unix://{sock_dir}/relay-0.sock"),
        svc(
            "main_decode",
            nats_b,
            DC_B,
            m + 3,
            bulk_address=f"tcp://{h.bind}:{opts.md_bulk_port}",  # advertised as is, or as this host's IP
        ),
        svc(
            "router",
            nats_a,
            DC_A,
            None,  # the router serves /metrics on its HTTP port
            host=h.bind,
            port=str(opts.router_port),
            **({"api_keys": ",".join(opts.api_keys)} if opts.api_keys else {}),
            # The router's link-estimator priors start from the emulated link's settings.
            default_bandwidth_bps=str(opts.bandwidth_mbps * 1e6 / 8),
            default_rtt_s=str(2 * opts.delay_ms / 1000),
        ),
    ]
