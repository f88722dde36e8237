"""pdd/launch.py: the env it sets is what shared/config.py reads; the topology is wired right."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pdd import launch
from pdd.launch import (
    COMPOSE_HOSTS,
    ENV_PREFIX,
    MAX_COUNT,
    PORT_BLOCK,
    Hosts,
    UpOptions,
    nats_specs,
    port_plan,
    router_urls,
    service_specs,
    wan_links,
    with_base_port,
)
from shared import config

SETTINGS = {
    "prefill": config.PrefillSettings,
    "relay": config.RelaySettings,
    "main_decode": config.MainDecodeSettings,
    "router": config.RouterSettings,
}


SCALED = dict(prefill=3, relay=2, md=3, routers=2, nats_cluster=3)


@pytest.mark.parametrize("hosts", [None, COMPOSE_HOSTS], ids=["local", "compose"])
@pytest.mark.parametrize("counts", [{}, SCALED], ids=["single", "scaled"])
def test_env_is_read_by_settings(hosts, counts, monkeypatch: pytest.MonkeyPatch) -> None:
    opts = UpOptions(
        model="/models/qwen",
        served_model_name="qwen",
        max_model_len=2048,
        dtype="bfloat16",
        tool_call_parser="llama3_json",
        **counts,
    )
    routers = [s for s in service_specs(opts, hosts) if s.service == "router"]
    assert all(s.env["PDD_ROUTER_TOOL_CALL_PARSER"] == "llama3_json" for s in routers)
    for spec in service_specs(opts, hosts)[1:]:
        prefix = ENV_PREFIX[spec.service]
        for key, value in spec.env.items():
            if key.startswith(prefix):
                monkeypatch.setenv(key, value)
        settings = SETTINGS[spec.service]()
        for key, value in spec.env.items():
            if not key.startswith(prefix):
                continue
            obj = settings
            for part in key.removeprefix(prefix).lower().split("__"):
                assert hasattr(obj, part), f"{key}: {type(obj).__name__} has no field {part!r}"
                obj = getattr(obj, part)
            if "{instance}" in value:  # compose: filled in from the container's hostname
                value = value.replace("{instance}", settings.instance)
            assert str(obj) == value or float(obj) == float(value), key


def test_engines_share_the_machine_s_cores_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMP_NUM_THREADS", "PDD_TORCH_THREADS", "PDD_MD_TORCH_THREADS"):
        monkeypatch.delenv(name, raising=False)
    opts, hosts = (
        UpOptions(prefill=2, relay=1, md=2),
        dataclasses.replace(Hosts.local("127.0.0.1"), shared_cores=16),
    )

    def threads(hosts: Hosts) -> dict[str, str | None]:
        return {
            s.name: s.env.get(f"{ENV_PREFIX[s.service]}TORCH_THREADS") for s in service_specs(opts, hosts)[1:]
        }

    assert threads(hosts) == {
        "prefill": "3",
        "prefill-1": "3",
        "relay": "3",
        "main_decode": "3",
        "main_decode-1": "3",
        "router": None,
    }
    assert set(threads(dataclasses.replace(hosts, shared_cores=3)).values()) == {"1", None}  # at least one
    assert set(threads(COMPOSE_HOSTS).values()) == {None}  # a container each: torch sizes itself
    monkeypatch.setenv("PDD_MD_TORCH_THREADS", "5")  # the operator's choice stands (services read it)
    assert threads(hosts)["main_decode"] is None and threads(hosts)["relay"] == "3"


def test_engines_held_to_one_thread_get_a_helper_and_decoders_give_way_to_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (
        "OMP_NUM_THREADS",
        "PDD_TORCH_THREADS",
        "PDD_MD_TORCH_THREADS",
        "PDD_MD_ENGINE__HELPER_THREADS",
        "PDD_PREFILL_ENGINE__HELPER_NICE",
        "PDD_MD_HOST_SHARE_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    opts = UpOptions()

    def env(hosts: Hosts, field: str) -> dict[str, str | None]:
        specs = service_specs(opts, hosts)[1:]
        return {s.name: s.env.get(f"{ENV_PREFIX[s.service]}{field}") for s in specs}

    local = Hosts.local("127.0.0.1")
    two = dataclasses.replace(local, shared_cores=2)  # three engines, one thread each
    assert env(two, "ENGINE__HELPER_THREADS") == {
        "prefill": "1",
        "relay": "1",
        "main_decode": "1",
        "router": None,
    }
    # Prefill's helper takes only what nothing else wants: the cores decoders leave it.
    assert env(two, "ENGINE__HELPER_NICE") == {
        "prefill": "19",
        "relay": None,
        "main_decode": None,
        "router": None,
    }
    shared = str(opts.workdir.resolve() / "host")
    assert env(two, "HOST_SHARE_DIR") == {
        "prefill": shared,
        "relay": shared,
        "main_decode": shared,
        "router": None,
    }
    for hosts in (dataclasses.replace(local, shared_cores=16), dataclasses.replace(local, shared_cores=1)):
        # 5 threads each, or no idle core: no helper, and nothing for decoders to give way to
        assert set(env(hosts, "ENGINE__HELPER_THREADS").values()) <= {"0", None}
        assert set(env(hosts, "HOST_SHARE_DIR").values()) == {None}
    assert set(env(COMPOSE_HOSTS, "ENGINE__HELPER_THREADS").values()) == {None}
    assert set(env(COMPOSE_HOSTS, "HOST_SHARE_DIR").values()) == {None}  # a container each
    monkeypatch.setenv("PDD_MD_ENGINE__HELPER_THREADS", "0")  # the operator's choice stands
    monkeypatch.setenv("PDD_MD_HOST_SHARE_DIR", "")
    assert env(two, "ENGINE__HELPER_THREADS")["main_decode"] is None
    assert env(two, "HOST_SHARE_DIR")["main_decode"] is None


def test_engines_on_this_host_get_tcmalloc_where_it_is_installed(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(launch, "TCMALLOC", (str(lib),))
    hosts = dataclasses.replace(Hosts.local("127.0.0.1"), shared_cores=4)

    def preload(hosts: Hosts) -> dict[str, str | None]:
        return {s.name: s.env.get("LD_PRELOAD") for s in service_specs(UpOptions(), hosts)[1:]}

    assert set(preload(hosts).values()) == {None}  # not installed
    lib.touch()
    assert preload(hosts) == {"prefill": str(lib), "relay": str(lib), "main_decode": str(lib), "router": None}
    assert set(preload(COMPOSE_HOSTS).values()) == {None}  # a container's paths are its own
    monkeypatch.setenv("LD_PRELOAD", "/elsewhere.so")  # the operator's choice stands
    assert set(preload(hosts).values()) == {None}


def test_topology() -> None:
    opts = UpOptions()
    specs = {s.name: s for s in service_specs(opts)}
    assert list(specs) == ["wan", "prefill", "relay", "main_decode", "router"]
    assert {s.name: s.datacenter for s in specs.values() if s.name != "wan"} == {
        "prefill": "dc-a",
        "relay": "dc-a",
        "main_decode": "dc-b",
        "router": "dc-a",
    }
    assert all(s.argv[1:] == ["-m", f"services.{s.name}"] for s in specs.values() if s.name != "wan")
    md = specs["main_decode"].env
    assert md["PDD_MD_NATS_URL"].endswith(f":{opts.nats_b_port}")
    assert md["PDD_MD_BULK_ADDRESS"] == f"tcp://127.0.0.1:{opts.md_bulk_port}"
    assert "PDD_MD_ADVERTISE_ADDRESS" not in md  # MD names its own address; P's link dials it
    assert specs["prefill"].env["PDD_PREFILL_BULK_VIA"] == f"tcp://127.0.0.1:{opts.wan_bulk_port}"
    assert specs["prefill"].env["PDD_PREFILL_NATS_URL"].endswith(f":{opts.nats_a_port}")
    assert specs["relay"].env["PDD_RELAY_LOCAL_ADDRESS"].startswith("unix:///")

    links = {link.name: link for link in wan_links(opts)}
    assert (links["bulk"].listen_port, links["bulk"].target) == (opts.wan_bulk_port, "127.0.0.1:7393-7400")
    a, b = nats_specs(opts)  # a lone server per DC: no cluster block, as always
    assert (a.name, b.name, a.cluster, b.cluster, a.routes, b.routes) == (
        "nats-a",
        "nats-b",
        None,
        None,
        [],
        [],
    )
    assert a.gateways == {"nats-b": f"nats://127.0.0.1:{links['gw-ab'].listen_port}"}
    assert b.gateways == {"nats-a": f"nats://127.0.0.1:{links['gw-ba'].listen_port}"}
    assert (
        links["gw-ab"].target == f"127.0.0.1:{b.gateway_port}"
        and links["gw-ba"].target == f"127.0.0.1:{a.gateway_port}"
    )
    assert (a.advertise, b.advertise) == ("127.0.0.1:7323", "127.0.0.1:7322")
    wan = specs["wan"].argv
    assert f"gw-ab=127.0.0.1:{opts.wan_gw_ab_port}>127.0.0.1:{opts.gw_b_port}" in wan
    assert wan[wan.index("--delay-ms") + 1] == "15.0"


def test_wan_flags_parse() -> None:
    from shared.wan.cli import build_parser, parse_link

    args = build_parser().parse_args(service_specs(UpOptions(**SCALED))[0].argv[3:])
    assert args.control == "127.0.0.1:7490" and args.bandwidth_mbps == 1000.0
    names = {f"gw-{d}-{c}" for d in ("ab", "ba") for c in range(3)} | {"bulk"}
    assert {parse_link(s, {}).name for s in args.link} == names


def test_today_s_ports_stay_for_instance_and_node_0() -> None:
    plan = port_plan(UpOptions(**SCALED))
    assert plan.router[0] == 8000 and plan.wan_control == 7490
    assert (plan.nats["dc-a"][0], plan.nats["dc-b"][0]) == (4222, 4223)
    assert (plan.gateway["dc-a"][0], plan.gateway["dc-b"][0]) == (7222, 7223)
    assert (plan.wan_gateway["dc-b"][0], plan.wan_gateway["dc-a"][0]) == (7322, 7323)
    assert (plan.md_bulk[0], plan.wan_bulk) == (7400, 7401)
    assert [plan.metrics[s][0] for s in ("prefill", "relay", "main_decode")] == [9101, 9102, 9103]


def _all_counts():
    return itertools.product(range(1, MAX_COUNT + 1), repeat=5)


@pytest.mark.parametrize("base", [None, 20000], ids=["default", "base-port"])
def test_port_plan_never_collides_and_fits_its_block(base) -> None:
    template = UpOptions() if base is None else with_base_port(UpOptions(), base)
    for prefill, relay, md, routers, nodes in _all_counts():
        counts = dict(prefill=prefill, relay=relay, md=md, routers=routers, nats_cluster=nodes)
        plan = port_plan(dataclasses.replace(template, **counts))
        ports = plan.ports()
        assert len(ports) == len(set(ports)), counts
        expected = routers + nodes * (6 if nodes == 1 else 8) + md + 2 + prefill + relay + md
        assert len(ports) == expected  # every instance and node has its own
        if base is not None:
            assert all(base <= p < base + PORT_BLOCK for p in ports), counts
    assert port_plan(UpOptions()) == port_plan(UpOptions())  # deterministic


def test_counts_are_validated_and_ports_that_collide_refused() -> None:
    for name in ("prefill", "relay", "md", "routers", "nats_cluster"):
        for bad in (0, MAX_COUNT + 1):
            with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be 1..{MAX_COUNT}"):
                UpOptions(**{name: bad})
    with pytest.raises(ValueError, match=r"ports used twice: \[4224\]"):
        UpOptions(nats_cluster=2, nats_b_port=4224)  # node 1 of dc-a is on 4224 already
    UpOptions(nats_b_port=4224)  # one node each: no clash
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, llama3_json"):
        UpOptions(tool_call_parser="mistral")


def test_every_instance_has_its_own_name_id_ports_and_socket() -> None:
    opts = UpOptions(**SCALED)
    specs = service_specs(opts)[1:]
    assert [s.name for s in specs] == [
        "prefill",
        "prefill-1",
        "prefill-2",
        "relay",
        "relay-1",
        "main_decode",
        "main_decode-1",
        "main_decode-2",
        "router",
        "router-1",
    ]
    ids = [s.env[f"{ENV_PREFIX[s.service]}INSTANCE"] for s in specs]
    assert ids == ["0", "1", "2", "0", "1", "0", "1", "2", "0", "1"]
    ports = [v for s in specs for k, v in s.env.items() if k.endswith(("_METRICS_PORT", "_ROUTER_PORT"))]
    assert len(ports) == len(specs) == len(set(ports))
    sockets = [s.env["PDD_RELAY_LOCAL_ADDRESS"] for s in specs if s.service == "relay"]
    assert [a.rsplit("/", 1)[1] for a in sockets] == ["relay-0.sock", "relay-1.sock"]
    assert router_urls(opts) == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert [s.env["PDD_ROUTER_PORT"] for s in specs if s.service == "router"] == ["8000", "8001"]


def test_kv_bulk_reaches_every_md_through_the_one_link() -> None:
    opts = UpOptions(**SCALED)
    specs = service_specs(opts)[1:]
    (bulk,) = [link for link in wan_links(opts) if link.name == "bulk"]
    host, ports = bulk.target.split(":")
    lo, hi = map(int, ports.split("-"))
    mds = [s.env["PDD_MD_BULK_ADDRESS"] for s in specs if s.service == "main_decode"]
    assert len(set(mds)) == 3 and all(
        a.startswith(f"tcp://{host}:") and lo <= int(a.rsplit(":", 1)[1]) <= hi for a in mds
    )
    # the pattern allows the ports MDs may take (also one started later) and no other port of the plan
    assert hi - lo + 1 == MAX_COUNT
    others = set(port_plan(opts).ports()) - {int(a.rsplit(":", 1)[1]) for a in mds}
    assert not any(lo <= p <= hi for p in others)
    assert {s.env["PDD_PREFILL_BULK_VIA"] for s in specs if s.service == "prefill"} == {
        f"tcp://127.0.0.1:{bulk.listen_port}"
    }
    assert not any(k.endswith("ADVERTISE_ADDRESS") for s in specs for k in s.env)


def test_nats_cluster_per_dc_behind_its_own_wan_links() -> None:
    opts = UpOptions(**SCALED)
    nodes = {n.name: n for n in nats_specs(opts)}
    links = {link.name: link for link in wan_links(opts)}
    assert list(nodes) == [f"nats-{d}-{c}" for d in "ab" for c in range(3)]
    for d, other, inbound in (("a", "b", "gw-ba"), ("b", "a", "gw-ab")):
        mine = [nodes[f"nats-{d}-{c}"] for c in range(3)]
        routes = [f"nats-route://127.0.0.1:{n.cluster_port}" for n in mine]
        remote = [f"nats://127.0.0.1:{links[f'gw-{d}{other}-{c}'].listen_port}" for c in range(3)]
        for c, node in enumerate(mine):
            assert (node.cluster, node.identity, node.routes) == (f"nats-{d}", f"nats-{d}", routes)
            assert node.gateways == {f"nats-{other}": remote}  # every remote node, via the WAN
            link = links[f"{inbound}-{c}"]  # the one link in front of this node's gateway
            assert (link.target, node.advertise) == (
                f"127.0.0.1:{node.gateway_port}",
                f"127.0.0.1:{link.listen_port}",
            )
    # every service instance is given every node of its own DC's cluster (it fails over among them)
    urls = {
        s.name: set(s.env[f"{ENV_PREFIX[s.service]}NATS_URL"].split(",")) for s in service_specs(opts)[1:]
    }
    a = {f"tls://127.0.0.1:{nodes[f'nats-a-{c}'].port}" for c in range(3)}
    b = {f"tls://127.0.0.1:{nodes[f'nats-b-{c}'].port}" for c in range(3)}
    for name, got in urls.items():
        assert got == (b if name.startswith("main_decode") else a), name


@pytest.mark.parametrize("hosts", [None, COMPOSE_HOSTS], ids=["local", "compose"])
def test_each_service_gets_its_own_credentials_as_paths(hosts) -> None:
    for spec in service_specs(UpOptions(**SCALED), hosts)[1:]:
        p, name = ENV_PREFIX[spec.service], spec.service
        env = spec.env
        assert env[f"{p}NATS_URL"].startswith("tls://")
        assert not any("NATS_USER" in k or "NATS_PASSWORD" in k for k in env)  # the certificate is the user
        assert env[f"{p}TLS_CERT"].endswith(f"/{name}.pem") and env[f"{p}TLS_KEY"].endswith(f"/{name}.key")
        # only the ends of the local KV path hold its key (dc-a); MD goes by its certificate
        assert (f"{p}SECRET_FILE" in env) == (name in ("prefill", "relay"))
        assert f"{p}SECRET" not in env  # values never ride in the environment


def test_up_creates_the_credentials_the_services_read(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdd.up import ensure_credentials
    from shared.security.credentials import require_credentials

    opts = UpOptions(workdir=tmp_path / "w", host="10.1.2.3")
    creds = ensure_credentials(opts)
    assert oct(creds.dir.stat().st_mode & 0o777) == "0o700"
    assert all(f.stat().st_mode & 0o077 == 0 for f in creds.dir.iterdir())
    first = creds.identity("relay").cert.read_bytes(), creds.secret_file.read_text()
    again = ensure_credentials(opts)  # the next start reuses them
    assert (again.identity("relay").cert.read_bytes(), again.secret_file.read_text()) == first
    for spec in service_specs(opts)[1:]:
        for key, value in spec.env.items():
            monkeypatch.setenv(key, value)
        settings = require_credentials(SETTINGS[spec.service](), spec.service, ENV_PREFIX[spec.service])
        assert settings.secret == (first[1] if spec.service in ("prefill", "relay") else None)
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(creds.identity("nats-a").cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"10.1.2.3", "127.0.0.1"} <= {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert {"wan", "nats-a", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    renewed = ensure_credentials(opts, renew=True)
    assert (
        renewed.identity("relay").cert.read_bytes() != first[0]
        and renewed.secret_file.read_text() != first[1]
    )
