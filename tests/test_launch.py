"""shared/launch.py: the env it sets is what shared/config.py reads; the topology is wired right."""

from __future__ import annotations

import pytest

from shared import config
from shared.launch import COMPOSE_HOSTS, ENV_PREFIX, UpOptions, nats_specs, service_specs, wan_links

SETTINGS = {
    "prefill": config.PrefillSettings,
    "relay": config.RelaySettings,
    "main_decode": config.MainDecodeSettings,
    "router": config.RouterSettings,
}


@pytest.mark.parametrize("hosts", [None, COMPOSE_HOSTS], ids=["local", "compose"])
def test_env_is_read_by_settings(hosts, monkeypatch: pytest.MonkeyPatch) -> None:
    opts = UpOptions(model_path="/models/qwen")
    for spec in service_specs(opts, hosts)[1:]:
        prefix = ENV_PREFIX[spec.name]
        for key, value in spec.env.items():
            if key.startswith(prefix):
                monkeypatch.setenv(key, value)
        settings = SETTINGS[spec.name]()
        for key, value in spec.env.items():
            if not key.startswith(prefix):
                continue
            obj = settings
            for part in key.removeprefix(prefix).lower().split("__"):
                assert hasattr(obj, part), f"{key}: {type(obj).__name__} has no field {part!r}"
                obj = getattr(obj, part)
            assert str(obj) == value or float(obj) == float(value), key


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
    assert md["PDD_MD_BULK_ADDRESS"] == f"tcp://127.0.0.1:{opts.md_bulk_port}" and "PDD_MD_ADVERTISE_ADDRESS" not in md
    # P dials every MD through the WAN
    assert specs["prefill"].env["PDD_PREFILL_BULK_VIA"] == f"tcp://127.0.0.1:{opts.wan_bulk_port}"
    assert specs["prefill"].env["PDD_PREFILL_NATS_URL"].endswith(f":{opts.nats_a_port}")
    assert specs["relay"].env["PDD_RELAY_LOCAL_ADDRESS"].startswith("unix:///")

    links = {link.name: link for link in wan_links(opts)}
    assert (links["bulk"].listen_port, links["bulk"].target_port) == (opts.wan_bulk_port, opts.md_bulk_port)
    a, b = nats_specs(opts)
    assert a.gateways == {"nats-b": f"nats://127.0.0.1:{links['gw-ab'].listen_port}"}
    assert links["gw-ab"].target_port == b.gateway_port and links["gw-ba"].target_port == a.gateway_port
    assert b.gateways == {"nats-a": f"nats://127.0.0.1:{links['gw-ba'].listen_port}"}
    wan = specs["wan"].argv
    assert f"bulk=127.0.0.1:{opts.wan_bulk_port}>127.0.0.1:{opts.md_bulk_port}-{opts.md_bulk_port + 9}" in wan
    assert f"gw-ab=127.0.0.1:{opts.wan_gw_ab_port}>127.0.0.1:{opts.gw_b_port}" in wan
    assert wan[wan.index("--delay-ms") + 1] == "15.0"


def test_wan_flags_parse() -> None:
    from shared.wan.cli import build_parser, parse_link

    args = build_parser().parse_args(service_specs(UpOptions())[0].argv[3:])
    assert args.control == "127.0.0.1:7490" and args.bandwidth_mbps == 1000.0
    assert {parse_link(s, {}).name for s in args.link} == {"gw-ab", "gw-ba", "bulk"}


def test_ports_are_distinct() -> None:
    opts = UpOptions()
    ports = [v for k, v in vars(opts).items() if k.endswith("_port")]
    ports += [opts.metrics_base_port + n for n in (1, 2, 3)]
    assert len(ports) == len(set(ports))


@pytest.mark.parametrize("hosts", [None, COMPOSE_HOSTS], ids=["local", "compose"])
def test_each_service_gets_its_own_credentials_as_paths(hosts) -> None:
    for spec in service_specs(UpOptions(), hosts)[1:]:
        p, name = ENV_PREFIX[spec.name], spec.name
        env = spec.env
        assert env[f"{p}NATS_URL"].startswith("tls://") and env[f"{p}NATS_USER"] == name
        assert env[f"{p}TLS_CERT"].endswith(f"/{name}.pem") and env[f"{p}TLS_KEY"].endswith(f"/{name}.key")
        assert env[f"{p}NATS_PASSWORD_FILE"].endswith(f"/{name}.nats-password")
        # only the ends of the KV channel hold its secret
        assert (f"{p}SECRET_FILE" in env) == (name != "router")
        assert not {f"{p}NATS_PASSWORD", f"{p}SECRET"} & set(env)  # values never ride in the environment


def test_up_creates_the_credentials_the_services_read(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.security.credentials import require_credentials
    from shared.up import ensure_credentials

    opts = UpOptions(workdir=tmp_path / "w", host="10.1.2.3")
    creds = ensure_credentials(opts)
    assert oct(creds.dir.stat().st_mode & 0o777) == "0o700"
    assert all(f.stat().st_mode & 0o077 == 0 for f in creds.dir.iterdir())
    first = creds.password("relay"), creds.secret_file.read_text()
    assert ensure_credentials(opts).password("relay") == first[0]  # the next start reuses them
    for spec in service_specs(opts)[1:]:
        for key, value in spec.env.items():
            monkeypatch.setenv(key, value)
        settings = require_credentials(SETTINGS[spec.name](), spec.name, ENV_PREFIX[spec.name],
                                       kv=spec.name != "router")  # fmt: skip
        assert settings.nats_password == creds.password(spec.name)
        assert settings.secret == (None if spec.name == "router" else first[1])
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(creds.identity("nats-a").cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"10.1.2.3", "127.0.0.1"} <= {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert {"wan", "nats-a", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    renewed = ensure_credentials(opts, renew=True)
    assert renewed.password("relay") != first[0] and renewed.secret_file.read_text() != first[1]
