"""The one description of which processes make up the two-DC system.

`pdd up` runs these specs on one machine; tests/integration/test_compose.py checks that every container
in compose.yaml runs the same command with the same environment (only the addresses in
`Hosts` differ), so the two cannot drift apart.

Topology: NATS in dc-a and dc-b, one server or a cluster of `nats_cluster` nodes
per DC, the two joined by NATS gateways whose connections cross the WAN emulator (one link in
front of every node's gateway port: gw-ab into dc-b, gw-ba into dc-a). KV bulk P -> MD crosses
the one link `bulk`, which dials on demand whichever MD the sender names. prefill, relay and
router instances live in dc-a, main_decode instances in dc-b.

Security is always on: every NATS connection, route and gateway runs mutual TLS, and each
service connects as its own NATS user (every instance of a role as the same one). The
credentials live in one secrets directory (shared/security/credentials.py); services get the
paths of their files in their settings.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import ENGINE_KINDS, ENV_PREFIX, TOOL_CALL_PARSERS, engine_unavailable
from shared.security.credentials import LOCAL_KV_SERVICES, Credentials
from shared.security.identity import NATS_DC, ROLE_DC

DC_A = "dc-a"
DC_B = "dc-b"
SERVICES = ("prefill", "relay", "main_decode", "router")
KV_SERVICES = ("prefill", "relay", "main_decode")  # ends of the KV bulk channel: they run an engine
DECODE_SERVICES = ("relay", "main_decode")
NATS_CLUSTER = {dc: name for name, dc in NATS_DC.items()}  # also each DC's gateway name
MAX_COUNT = 8  # most instances of one role, and most NATS nodes per DC
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
COUNTS = {"prefill": "prefill", "relay": "relay", "main_decode": "md", "router": "routers"}  # UpOptions field


@dataclass
class UpOptions:
    """Flags of `pdd up`. The ports are those of instance / node 0; port_plan() places the rest."""

    host: str = "127.0.0.1"
    router_port: int = 8000
    delay_ms: float = 15.0  # one-way WAN delay
    jitter_ms: float = 2.0
    bandwidth_mbps: float = 1000.0  # 0: uncapped
    # What to serve (vLLM's --model): a Hugging Face directory or a .gguf file; or a seeded
    # preset (tiny | small | medium); neither: the embedded default, SmolLM2-135M-Instruct.
    model: str | None = None
    model_preset: str | None = None
    served_model_name: str | None = None  # the API's model id; default: --model as given
    max_model_len: int | None = None  # default: the model's context length
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # KV cache memory of the machine, GiB, split evenly among the engines on it: vLLM's
    # VLLM_CPU_KVCACHE_SPACE default for its one CPU engine (on CUDA each engine takes
    # gpu_memory_utilization of its device instead; PDD_ENGINE__GPU_MEMORY_UTILIZATION).
    kv_cache_space: float = 4.0
    workdir: Path = Path(".pdd")
    prefill: int = 1  # instances of each role
    relay: int = 1
    md: int = 1
    routers: int = 1
    nats_cluster: int = 1  # NATS nodes per datacenter
    nats_a_port: int = 4222
    nats_b_port: int = 4223
    nats_a_cluster_port: int = 6222  # routes between the nodes of a cluster (nats_cluster > 1)
    nats_b_cluster_port: int = 6223
    gw_a_port: int = 7222
    gw_b_port: int = 7223
    wan_gw_ab_port: int = 7322
    wan_gw_ba_port: int = 7323
    md_bulk_port: int = 7400
    wan_bulk_port: int = 7401
    wan_control_port: int = 7490
    metrics_base_port: int = 9100
    api_keys: tuple[str, ...] = ()  # router API keys (`--api-key`, repeatable); none: the API is open
    # How the model writes tool calls (vLLM's --tool-call-parser): hermes | llama3_json; none:
    # what the model's chat template teaches (hermes unless it is Llama 3's).
    tool_call_parser: str | None = None
    engine: str = "pdd"  # the engines' kind (PDD_ENGINE__KIND): pdd | vllm (where vLLM is installed)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"--engine must be one of {', '.join(ENGINE_KINDS)}, got {self.engine!r}")
        if (why := engine_unavailable(self.engine)) is not None:
            raise ValueError(f"--engine {self.engine}: {why}")
        if not self.kv_cache_space > 0:
            raise ValueError(f"--kv-cache-space must be > 0 GiB, got {self.kv_cache_space}")
        for name in (*COUNTS.values(), "nats_cluster"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
                raise ValueError(f"--{name.replace('_', '-')} must be 1..{MAX_COUNT}, got {value!r}")
        port_plan(self)  # refuses colliding ports


def instance_counts(opts: UpOptions) -> dict[str, int]:
    return {service: getattr(opts, flag) for service, flag in COUNTS.items()}


def process_name(service: str, instance: int) -> str:
    """Instance 0 keeps the bare role name (its logs and pid file keep theirs)."""
    return service if instance == 0 else f"{service}-{instance}"


# `--base-port B`: every port of the system in one block B..B+PORT_BLOCK-1 (tests run several
# systems). Each entry is the port of instance / node 0; the others follow at PORT_STEP.
PORT_BLOCK = 110
PORT_OFFSETS = {
    "router_port": 0,  # +0..+7
    "nats_a_port": 8,  # +8..+23, the two DCs interleaved
    "nats_b_port": 9,
    "nats_a_cluster_port": 24,  # +24..+39
    "nats_b_cluster_port": 25,
    "gw_a_port": 40,  # +40..+55
    "gw_b_port": 41,
    "wan_gw_ab_port": 56,  # +56..+71
    "wan_gw_ba_port": 57,
    "md_bulk_port": 79,  # down to +72
    "wan_bulk_port": 80,
    "metrics_base_port": 84,  # services use +85..+108
    "wan_control_port": 109,
}
# Distance between the ports of consecutive instances / nodes. The two DCs' NATS ports
# interleave (4222, 4223, 4224, ...), and so do the three services' metrics ports. MD bulk
# ports count down, so that they stay one range next to the WAN bulk port above them.
PAIR_STEP, METRICS_STEP, MD_BULK_STEP = 2, len(KV_SERVICES), -1


def with_base_port(opts: UpOptions, base: int) -> UpOptions:
    return dataclasses.replace(opts, **{name: base + off for name, off in PORT_OFFSETS.items()})


def _series(first: int, step: int, n: int) -> tuple[int, ...]:
    return tuple(first + step * i for i in range(n))


@dataclass(frozen=True)
class PortPlan:
    """Every port of one system, per instance or node; a function of UpOptions alone."""

    router: tuple[int, ...]
    nats: dict[str, tuple[int, ...]]  # DC -> client port of each node
    cluster: dict[str, tuple[int, ...]]  # DC -> route port of each node (none for a lone server)
    gateway: dict[str, tuple[int, ...]]  # DC -> gateway port of each node
    wan_gateway: dict[str, tuple[int, ...]]  # DC -> WAN link in front of each node's gateway
    md_bulk: tuple[int, ...]
    metrics: dict[str, tuple[int, ...]]  # service -> each instance's (the router serves its HTTP port)
    wan_bulk: int
    wan_control: int

    def ports(self) -> list[int]:
        per_dc = [
            p
            for d in (self.nats, self.cluster, self.gateway, self.wan_gateway)
            for ps in d.values()
            for p in ps
        ]
        per_service = [p for ps in self.metrics.values() for p in ps]
        return [*self.router, *per_dc, *self.md_bulk, *per_service, self.wan_bulk, self.wan_control]


def port_plan(opts: UpOptions) -> PortPlan:
    """Every port for the counts in `opts`; ValueError when two would collide (explicit flags)."""
    n, counts = opts.nats_cluster, instance_counts(opts)

    def pair(a: int, b: int, used: bool = True) -> dict[str, tuple[int, ...]]:
        return {DC_A: _series(a, PAIR_STEP, n if used else 0), DC_B: _series(b, PAIR_STEP, n if used else 0)}

    plan = PortPlan(
        router=_series(opts.router_port, 1, opts.routers),
        nats=pair(opts.nats_a_port, opts.nats_b_port),
        cluster=pair(opts.nats_a_cluster_port, opts.nats_b_cluster_port, used=n > 1),
        gateway=pair(opts.gw_a_port, opts.gw_b_port),
        wan_gateway=pair(opts.wan_gw_ba_port, opts.wan_gw_ab_port),  # gw-ba leads into dc-a
        md_bulk=_series(opts.md_bulk_port, MD_BULK_STEP, opts.md),
        metrics={
            s: _series(opts.metrics_base_port + 1 + r, METRICS_STEP, counts[s])
            for r, s in enumerate(KV_SERVICES)
        },
        wan_bulk=opts.wan_bulk_port,
        wan_control=opts.wan_control_port,
    )
    ports = plan.ports()
    if len(set(ports)) < len(ports):
        clashes = sorted(p for p, k in Counter(ports).items() if k > 1)
        raise ValueError(f"ports used twice: {clashes} (check the --*-port flags against the counts)")
    return plan


def client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def router_urls(opts: UpOptions) -> list[str]:
    """Every router's base URL; the routers are interchangeable."""
    return [f"http://{client_host(opts.host)}:{port}" for port in port_plan(opts).router]


@dataclass(frozen=True)
class Hosts:
    """What differs between one machine (`pdd up`) and one container per process (compose)."""

    bind: str  # address listeners bind to
    wan: str
    nats: str | None = None  # host of every NATS node; None = the node's own name (a container each)
    md: str = "*"  # host the bulk link may dial ("*": any, MD replicas' addresses are not known ahead)
    socket_dir: str | None = None  # relay's unix socket directory; None = the workdir
    secrets_dir: str | None = None  # credentials (shared/security/credentials.py); None = <workdir>/secrets
    trace_dir: str | None = None  # the local span store; None = <workdir>/traces
    instance_ids: bool = True  # set PDD_<ROLE>_INSTANCE; compose leaves it to the container
    shared_cores: int | None = None  # cores every engine process shares (one machine); None: its own

    @classmethod
    def local(cls, host: str) -> Hosts:
        return cls(bind=host, wan=host, nats=host, md=host, shared_cores=len(os.sched_getaffinity(0)))


COMPOSE_WORKDIR = "/pdd"  # a volume: the certs service writes the credentials, the rest read them
# Compose service names double as hostnames; the relay socket lives on a shared volume.
COMPOSE_HOSTS = Hosts(
    bind="0.0.0.0",
    wan="wan",
    socket_dir="/run/pdd",
    secrets_dir=f"{COMPOSE_WORKDIR}/secrets",
    trace_dir="/traces",  # a volume every service writes; compose also exports OTLP to Jaeger
    instance_ids=False,
)


@dataclass
class ProcessSpec:
    name: str  # process name: logs/<name>.log, run/<name>.pid
    argv: list[str]
    env: dict[str, str]
    datacenter: str
    service: str | None = None  # its role (one of SERVICES) when it is a service instance


@dataclass
class LinkSpec:
    """One emulated WAN direction: listen on `listen_port`, forward to `target` (host:port, or a
    pattern `HOST:LO-HI` / `*:PORT` the client picks from, shared/wan/via.py)."""

    name: str
    listen_port: int
    target: str


@dataclass
class NatsSpec:
    """One NATS server; `gateways` maps remote gateway name -> its URL(s), via the WAN."""

    name: str
    datacenter: str
    port: int
    gateway_port: int
    gateways: dict[str, str | list[str]] = field(default_factory=dict)
    advertise: str | None = None  # gateway address peers should use (the WAN link in front of it)
    cluster: str | None = None  # the DC's cluster (also its gateway name); None: a lone server
    cluster_port: int | None = None
    routes: list[str] = field(default_factory=list)  # nats-route://host:port of every node of the cluster

    @property
    def identity(self) -> str:
        """Whose certificate it serves: the nodes of one DC share theirs."""
        return self.cluster or self.name


def secrets_dir(opts: UpOptions, hosts: Hosts | None = None) -> Path:
    h = hosts or Hosts.local(opts.host)
    return Path(h.secrets_dir) if h.secrets_dir else opts.workdir.resolve() / "secrets"


def certs_spec() -> ProcessSpec:
    """Compose's one-shot init: create the credentials and the NATS configs unless present."""
    argv = [sys.executable, "-m", "pdd.cli", "certs", "--keep", "--compose", "--workdir", COMPOSE_WORKDIR]
    return ProcessSpec("certs", argv, {"PYTHONUNBUFFERED": "1"}, DC_A)


def nats_node_name(dc: str, node: int, nodes: int) -> str:
    """nats-a for a lone server (as always), nats-a-<node> in a cluster."""
    return NATS_CLUSTER[dc] if nodes == 1 else f"{NATS_CLUSTER[dc]}-{node}"


def _nats_host(h: Hosts, dc: str, node: int, nodes: int) -> str:
    return h.nats or nats_node_name(dc, node, nodes)


def other_dc(dc: str) -> str:
    return DC_B if dc == DC_A else DC_A


def wan_links(opts: UpOptions, hosts: Hosts | None = None) -> list[LinkSpec]:
    """gw-ab(-<node>) in front of each dc-b node's gateway, gw-ba(-<node>) of each dc-a node's;
    `bulk` in front of every MD: the sender names its MD, within the MDs' port range."""
    h, plan, n = hosts or Hosts.local(opts.host), port_plan(opts), opts.nats_cluster
    links = []
    for dc, direction in ((DC_B, "gw-ab"), (DC_A, "gw-ba")):
        for node, listen in enumerate(plan.wan_gateway[dc]):
            target = f"{_nats_host(h, dc, node, n)}:{plan.gateway[dc][node]}"
            links.append(LinkSpec(direction if n == 1 else f"{direction}-{node}", listen, target))
    # Every port an MD may take (MAX_COUNT of them), so an MD started later is reachable too.
    lowest = opts.md_bulk_port + MD_BULK_STEP * (MAX_COUNT - 1)
    ports = f"{lowest}-{opts.md_bulk_port}" if h.md != "*" else str(opts.md_bulk_port)
    links.append(LinkSpec("bulk", plan.wan_bulk, f"{h.md}:{ports}"))
    return links


def nats_specs(opts: UpOptions, hosts: Hosts | None = None) -> list[NatsSpec]:
    """Every node of both DCs. A node dials the other DC's gateways through the WAN links in
    front of them, and advertises the link in front of itself, so gateway gossip never teaches a
    peer a direct address that would bypass the emulator."""
    h, plan, n = hosts or Hosts.local(opts.host), port_plan(opts), opts.nats_cluster
    specs = []
    for dc in (DC_A, DC_B):
        remote = [f"nats://{h.wan}:{p}" for p in plan.wan_gateway[other_dc(dc)]]
        routes = [f"nats-route://{_nats_host(h, dc, c, n)}:{p}" for c, p in enumerate(plan.cluster[dc])]
        for node in range(n):
            specs.append(
                NatsSpec(
                    nats_node_name(dc, node, n),
                    dc,
                    plan.nats[dc][node],
                    plan.gateway[dc][node],
                    {NATS_CLUSTER[other_dc(dc)]: remote[0] if n == 1 else remote},
                    advertise=f"{h.wan}:{plan.wan_gateway[dc][node]}",
                    cluster=NATS_CLUSTER[dc] if n > 1 else None,
                    cluster_port=plan.cluster[dc][node] if n > 1 else None,
                    routes=routes,
                )
            )
    return specs


def wan_spec(opts: UpOptions, hosts: Hosts | None = None) -> ProcessSpec:
    """`python -m shared.wan`: every link in one emulator process, plus its HTTP control API."""
    h = hosts or Hosts.local(opts.host)
    argv = [sys.executable, "-m", "shared.wan", "--control", f"{h.bind}:{opts.wan_control_port}"]
    argv += ["--delay-ms", str(opts.delay_ms), "--jitter-ms", str(opts.jitter_ms)]
    argv += ["--bandwidth-mbps", str(opts.bandwidth_mbps)]
    for link in wan_links(opts, h):
        argv += ["--link", f"{link.name}={h.bind}:{link.listen_port}>{link.target}"]
    return ProcessSpec("wan", argv, {"PYTHONUNBUFFERED": "1"}, DC_A)


def nats_urls(opts: UpOptions, hosts: Hosts, dc: str) -> list[str]:
    """The client URL of every NATS node of a DC."""
    n = opts.nats_cluster
    return [f"tls://{_nats_host(hosts, dc, c, n)}:{port}" for c, port in enumerate(port_plan(opts).nats[dc])]


def nats_url(opts: UpOptions, hosts: Hosts, dc: str) -> str:
    """PDD_<ROLE>_NATS_URL: every node of the DC's cluster, comma-separated. The client picks
    one at random (spreading the instances) and fails over to the others."""
    return ",".join(nats_urls(opts, hosts, dc))


def _service_env(name: str, instance: int, opts: UpOptions, h: Hosts, dc: str) -> dict[str, str]:
    p = ENV_PREFIX[name]
    env = {
        "PYTHONUNBUFFERED": "1",
        f"{p}NATS_URL": nats_url(opts, h, dc),
        **({f"{p}INSTANCE": str(instance)} if h.instance_ids else {}),  # compose: the container's hostname
        f"{p}DATACENTER": dc,
        **_model_env(p, opts),
        **_credentials_env(name, secrets_dir(opts, h)),
    }
    if name in KV_SERVICES and h.shared_cores:  # engines on one machine share its KV space
        engines = sum(instance_counts(opts)[s] for s in KV_SERVICES)
        env[f"{p}ENGINE__KV_CACHE_SPACE_GIB"] = f"{opts.kv_cache_space / engines:g}"
    if name != "router":  # the router serves /metrics on its HTTP port
        env[f"{p}METRICS_PORT"] = str(port_plan(opts).metrics[name][instance])
        env[f"{p}METRICS_HOST"] = h.bind  # like the service: loopback under `pdd up`
    env["PDD_TRACE_DIR"] = h.trace_dir or str(opts.workdir.resolve() / "traces")
    threads = f"{p}TORCH_THREADS"
    if (
        name in KV_SERVICES
        and h.shared_cores
        and not {threads, "PDD_TORCH_THREADS", "OMP_NUM_THREADS"} & set(os.environ)
    ):
        env[threads] = str(torch_threads_share(opts, h.shared_cores))
    local = name in KV_SERVICES and h.shared_cores  # processes on this host, not containers
    # pdd's engine only: vLLM's engines have no helper threads to take a core a decoder leaves
    helpers = helper_threads(opts, h.shared_cores) if local and opts.engine == "pdd" else 0
    if local and f"{p}ENGINE__HELPER_THREADS" not in os.environ:
        env[f"{p}ENGINE__HELPER_THREADS"] = str(helpers)
        nice = f"{p}ENGINE__HELPER_NICE"
        if name not in DECODE_SERVICES and nice not in os.environ:  # only cores the decoders left idle
            env[nice] = "19"
    # Decoders give way to prefill's backlog where its helper can take the cores they leave.
    if helpers and f"{p}HOST_SHARE_DIR" not in os.environ:
        env[f"{p}HOST_SHARE_DIR"] = str(opts.workdir.resolve() / "host")
    if local and "LD_PRELOAD" not in os.environ and (lib := tcmalloc_path()):
        # vLLM's CPU build also wants the OpenMP runtime it ships (libiomp5, in its environment)
        iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
        env["LD_PRELOAD"] = f"{lib}:{iomp}" if opts.engine == "vllm" and os.path.exists(iomp) else lib
    return env


def _model_env(p: str, opts: UpOptions) -> dict[str, str]:
    """What to serve, as every service reads it: only what was given (the services' own
    defaults are the rest: the embedded model, auto dtype, the model's context length)."""
    given = {
        "MODEL__PATH": opts.model,
        "MODEL__PRESET": opts.model_preset,
        "MODEL__SERVED_MODEL_NAME": opts.served_model_name,
        "MODEL__DTYPE": None if opts.dtype == "auto" else opts.dtype,
        "ENGINE__MAX_MODEL_LEN": opts.max_model_len,
        "ENGINE__KIND": None if opts.engine == "pdd" else opts.engine,
    }
    return {f"{p}{k}": str(v) for k, v in given.items() if v is not None}


# tcmalloc (Debian: libtcmalloc-minimal4), as vLLM's CPU build asks for: the engines' large
# per-step activations are reused rather than mapped and faulted in again (~10% on the
# engine's mixed workload on the CPU). Used when installed, unless LD_PRELOAD is set already.
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)


def tcmalloc_path() -> str | None:
    return next((p for p in TCMALLOC if os.path.exists(p)), None)


def torch_threads_share(opts: UpOptions, cores: int) -> int:
    """Each engine's torch threads on one machine: a fair share of its cores (torch's default,
    all of them in every process, oversubscribes them as many times as there are engines)."""
    engines = sum(instance_counts(opts)[s] for s in KV_SERVICES)
    return max(1, cores // engines)


def helper_threads(opts: UpOptions, cores: int) -> int:
    """An engine held to one torch thread gets one low-priority helper for its kernels (panel
    products, paged attention) that takes whichever core is idle at the moment without taking
    time from anything else. A decode step is bound by reading the weights, and one core alone
    reads them at a fraction of what two do. Prefill's helper (at niceness 19) finds a core
    when the decoders give way to its backlog (shared/serving/host_share.py): a 256-token
    chunk in 75 ms instead of 113."""
    return 1 if torch_threads_share(opts, cores) == 1 and cores > 1 else 0


def _credentials_env(name: str, directory: Path) -> dict[str, str]:
    """The paths of this service's own credentials; never the secrets themselves."""
    creds, p = Credentials(directory), ENV_PREFIX[name]
    ident = creds.identity(name)
    env = {
        f"{p}TLS_CA": str(ident.ca),
        f"{p}TLS_CERT": str(ident.cert),
        f"{p}TLS_KEY": str(ident.key),
    }
    if name in LOCAL_KV_SERVICES:  # MD holds no KV key: TCP peers go by their certificates' identity
        env[f"{p}SECRET_FILE"] = str(creds.secret_file)
    return env


def _role_settings(name: str, instance: int, opts: UpOptions, h: Hosts) -> dict[str, str]:
    """The settings only this role has, for one instance."""
    plan = port_plan(opts)
    if name == "prefill":  # KV to any MD goes through the one bulk link
        return {"bulk_via": f"tcp://{h.wan}:{plan.wan_bulk}"}
    if name == "relay":
        ident = str(instance) if h.instance_ids else "{instance}"  # compose: the container's id
        return {"local_address": f"unix://{h.socket_dir or opts.workdir.resolve()}/relay-{ident}.sock"}
    if name == "main_decode":  # no advertise override: MD names its own address, P's link dials it
        return {"bulk_address": f"tcp://{h.bind}:{plan.md_bulk[instance]}"}
    return {
        "host": h.bind,
        "port": str(plan.router[instance]),
        **({"api_keys": ",".join(opts.api_keys)} if opts.api_keys else {}),
        **({"tool_call_parser": opts.tool_call_parser} if opts.tool_call_parser else {}),
        # The router's link-estimator priors start from the emulated link's settings.
        "default_bandwidth_bps": str(opts.bandwidth_mbps * 1e6 / 8),
        "default_rtt_s": str(2 * opts.delay_ms / 1000),
    }


def datacenter(service: str) -> str:
    """Where a role runs: main decode in dc-b, everything else in dc-a."""
    return ROLE_DC[service]


def service_spec(name: str, instance: int, opts: UpOptions, hosts: Hosts | None = None) -> ProcessSpec:
    h = hosts or Hosts.local(opts.host)
    dc = datacenter(name)
    env = _service_env(name, instance, opts, h, dc)
    env.update({ENV_PREFIX[name] + k.upper(): v for k, v in _role_settings(name, instance, opts, h).items()})
    argv = [sys.executable, "-m", f"services.{name}"]
    return ProcessSpec(process_name(name, instance), argv, env, dc, service=name)


def service_specs(opts: UpOptions, hosts: Hosts | None = None) -> list[ProcessSpec]:
    """wan, then every instance of prefill, relay, main_decode, router — in start order (the
    routers last: they are the health gate)."""
    counts = instance_counts(opts)
    instances = [service_spec(name, i, opts, hosts) for name in SERVICES for i in range(counts[name])]
    return [wan_spec(opts, hosts), *instances]
