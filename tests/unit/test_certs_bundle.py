"""`pdd certs bundle | add-host | add-instance`: what a DC's bundle holds, and what issuing
one more host or instance leaves alone."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from cryptography import x509

from pdd import cli
from pdd.certs import DC_SERVICES, bundle_nats_config, parse_env
from shared.security.identity import peer_identity


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def names(path: Path) -> set[str]:
    san = cert(path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in san.get_values_for_type(x509.DNSName) + san.get_values_for_type(x509.IPAddress)}


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def credentials(secrets: Path) -> dict[str, bytes]:
    """The workdir's credentials, less its record of where each bundle went."""
    return {n: b for n, b in snapshot(secrets).items() if not n.startswith("bundle-")}


@pytest.fixture
def made(tmp_path) -> dict[str, Path]:
    w = tmp_path / "w"
    for dc, host in (("dc-a", "10.200.0.1"), ("dc-b", "10.200.0.2")):
        argv = ["certs", "bundle", "--dc", dc, "--out", str(tmp_path / dc), "--workdir", str(w)]
        assert cli.main([*argv, "--host", host, "--env", "PDD_NATS_URL=tls://nats.example:4222"]) == 0
    return {"w": w / "secrets", "dc-a": tmp_path / "dc-a", "dc-b": tmp_path / "dc-b"}


def test_bundle_holds_exactly_its_dc_and_never_the_ca_key(made) -> None:
    ca_key = (made["w"] / "ca.key").read_bytes()
    for dc, nats, other in (("dc-a", "nats-a", "dc-b"), ("dc-b", "nats-b", "dc-a")):
        b, services = made[dc], DC_SERVICES[dc]
        expect = {"ca.pem", "bundle.json", *(f"{nats}.{x}" for x in ("pem", "key", "conf"))}
        expect |= {f"{s}.{x}" for s in services for x in ("pem", "key", "env")}
        expect |= {"kv-local-secret"} if dc == "dc-a" else set()
        assert set(snapshot(b)) == expect
        for name, data in snapshot(b).items():  # no private key but each leaf's own
            assert ca_key not in data and (name.endswith(".key") or b"PRIVATE KEY" not in data), name
        assert stat.S_IMODE(b.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in b.iterdir())
        meta = json.loads((b / "bundle.json").read_text())
        assert meta["dc"] == dc and meta["services"] == list(services) and meta["nats"] == nats
        assert len(meta["ca_fingerprint"]) == 64 and meta["hosts"] == [
            "10.200.0.1" if dc == "dc-a" else "10.200.0.2"
        ]
        for s in services:  # every certificate names this DC's role, none the other's
            assert peer_identity(cert(b / f"{s}.pem")) == (dc, s, None)
        assert peer_identity(cert(b / f"{nats}.pem")) == (dc, "nats", nats)
        conf = (b / f"{nats}.conf").read_text()
        for s in DC_SERVICES[other]:  # the other DC's users are absent
            assert f'user: "CN={s},OU={other},O=pdd"' not in conf
        # each user is a certificate's subject, with no password that could stand in for it
        assert all(f'{{user: "CN={s},OU={dc},O=pdd", permissions: ' in conf for s in services)
        assert "password" not in conf and "verify_and_map: true" in conf


def test_env_files_name_the_bundles_files_relatively(made) -> None:
    env = dict(
        line.split("=", 1) for line in (made["dc-a"] / "prefill.env").read_text().splitlines() if "=" in line
    )
    assert env == {
        "PDD_PREFILL_DATACENTER": "dc-a",
        "PDD_PREFILL_TLS_CA": "ca.pem",
        "PDD_PREFILL_TLS_CERT": "prefill.pem",
        "PDD_PREFILL_TLS_KEY": "prefill.key",
        "PDD_PREFILL_SECRET_FILE": "kv-local-secret",
        "PDD_NATS_URL": "tls://nats.example:4222",
    }
    md = (made["dc-b"] / "main_decode.env").read_text()
    assert "PDD_MD_TLS_CERT=main_decode.pem" in md and "SECRET" not in md  # MD holds no KV key
    with pytest.raises(ValueError):
        parse_env(["PDD_X=1\nPDD_Y=2"])


def test_bundles_leave_the_workdir_and_each_other_alone(made, tmp_path) -> None:
    before = snapshot(made["w"]), snapshot(made["dc-b"])
    argv = ["certs", "bundle", "--dc", "dc-a", "--out", str(made["dc-a"]), "--workdir", str(tmp_path / "w")]
    assert cli.main([*argv, "--host", "10.200.0.1"]) == 0  # dc-a again: new leaves for dc-a only
    assert (snapshot(made["w"]), snapshot(made["dc-b"])) == before


def test_add_host_reissues_only_the_bundles_role_wide_certificates(made, tmp_path) -> None:
    w = str(tmp_path / "w")
    argv = ["certs", "add-instance", "--dc", "dc-b", "--role", "main_decode", "--instance", "md-2"]
    assert cli.main([*argv, "--out", str(made["dc-b"]), "--workdir", w]) == 0
    before, others = snapshot(made["dc-b"]), (snapshot(made["dc-a"]), credentials(made["w"]))
    argv = ["certs", "add-host", "--dc", "dc-b", "--host", "gw.dc-b.example", "--workdir", w]
    assert cli.main(argv) == 0  # the bundle is found where `bundle` wrote it
    after = snapshot(made["dc-b"])
    changed = {n for n in after if after[n] != before.get(n)}
    assert changed == {"nats-b.pem", "nats-b.key", "main_decode.pem", "main_decode.key", "bundle.json"}
    assert (snapshot(made["dc-a"]), credentials(made["w"])) == others  # and md-2's are as they were
    for name in ("nats-b", "main_decode"):
        assert {"gw.dc-b.example", "10.200.0.2", name, "127.0.0.1"} <= names(made["dc-b"] / f"{name}.pem")
    assert peer_identity(cert(made["dc-b"] / "main_decode.pem")) == ("dc-b", "main_decode", None)
    assert json.loads(after["bundle.json"])["hosts"] == ["10.200.0.2", "gw.dc-b.example"]


def test_add_instance_issues_its_own_identity_beside_the_others(made, tmp_path) -> None:
    before, work = snapshot(made["dc-b"]), snapshot(made["w"])
    argv = ["certs", "add-instance", "--dc", "dc-b", "--role", "main_decode", "--instance", "md-2"]
    argv += ["--host", "10.200.0.3", "--out", str(made["dc-b"]), "--workdir", str(tmp_path / "w")]
    assert cli.main(argv) == 0
    after = snapshot(made["dc-b"])
    assert {n: after[n] for n in before} == before and snapshot(made["w"]) == work
    assert set(after) - set(before) == {
        "main_decode-md-2.pem",
        "main_decode-md-2.key",
        "main_decode-md-2.env",
    }
    assert peer_identity(cert(made["dc-b"] / "main_decode-md-2.pem")) == ("dc-b", "main_decode", "md-2")
    assert "10.200.0.3" in names(made["dc-b"] / "main_decode-md-2.pem")
    env = after["main_decode-md-2.env"].decode()
    assert "PDD_MD_INSTANCE=md-2" in env and "PDD_MD_TLS_CERT=main_decode-md-2.pem" in env
    for role, instance in (("prefill", "p"), ("main_decode", "../x")):  # not in dc-b; not an id
        bad = ["certs", "add-instance", "--dc", "dc-b", "--role", role, "--instance", instance]
        assert cli.main([*bad, "--out", str(tmp_path / "x"), "--workdir", str(tmp_path / "w")]) == 2


def test_nats_config_renders_flags_for_where_the_bundle_is(made) -> None:
    conf = bundle_nats_config(
        made["dc-b"], gateway_urls=["nats://10.200.0.1:7300"], advertise="10.200.0.1:7301"
    )
    assert 'listen: "0.0.0.0:4223"' in conf and 'listen: "0.0.0.0:7223"' in conf
    assert (
        '{name: "nats-a", urls: ["nats://10.200.0.1:7300"]}' in conf
        and 'advertise: "10.200.0.1:7301"' in conf
    )
    assert f'cert_file: "{made["dc-b"]}/nats-b.pem"' in conf


def test_each_env_file_gives_its_service_what_it_requires(made, monkeypatch) -> None:
    """Read as `pdd serve SERVICE --env-file` reads it (relative paths against the bundle)."""
    from shared.config import ENV_PREFIX, MainDecodeSettings, PrefillSettings, RelaySettings, RouterSettings
    from shared.env_file import parse_env_file
    from shared.security.credentials import require_credentials

    kinds = {"prefill": PrefillSettings, "relay": RelaySettings, "main_decode": MainDecodeSettings}
    kinds["router"] = RouterSettings
    for dc in ("dc-a", "dc-b"):
        for service in DC_SERVICES[dc]:
            for key, value in parse_env_file(made[dc] / f"{service}.env").items():
                monkeypatch.setenv(key, value)
            settings = require_credentials(kinds[service](), service, ENV_PREFIX[service])
            assert settings.datacenter == dc
            assert settings.tls_cert == str(made[dc] / f"{service}.pem")
            assert (settings.secret is not None) == (service in ("prefill", "relay"))
