"""`pdd` argument parsing and `pdd trace` over a span store written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd import cli
from pdd.launch import UpOptions
from shared.telemetry import tracing


def test_up_flags_map_to_up_options() -> None:
    args, extra = cli.parse_args(["up", "--port", "9000", "--delay-ms", "40", "--model", "/m", "--smoke"])
    opts = cli.up_options(args)
    assert extra == [] and args.smoke
    assert (opts.router_port, opts.delay_ms, opts.model) == (9000, 40.0, "/m")
    assert cli.up_options(cli.parse_args(["up"])[0]) == UpOptions()
    assert isinstance(cli.up_options(cli.parse_args(["up", "--workdir", "/x"])[0]).workdir, Path)


def test_api_keys_reach_the_router_and_only_the_router() -> None:
    from pdd.launch import service_specs

    opts = cli.up_options(cli.parse_args(["up", "--api-key", "k1", "--api-key", "k2"])[0])
    assert opts.api_keys == ("k1", "k2")
    env = {s.name: s.env for s in service_specs(opts)}
    assert env["router"]["PDD_ROUTER_API_KEYS"] == "k1,k2"
    assert not any("API_KEYS" in k for name, e in env.items() if name != "router" for k in e)
    assert not any("API_KEYS" in k for k in service_specs(UpOptions())[-1].env)  # no flag: open


def test_base_port_moves_every_port_but_explicit_flags_win() -> None:
    from pdd.launch import PORT_BLOCK, port_plan

    opts = cli.up_options(cli.parse_args(["up", "--base-port", "20000", "--nats-b-port", "5555"])[0])
    ports = {k: v for k, v in vars(opts).items() if k.endswith("_port")}
    assert (
        opts.router_port == 20000
        and opts.wan_control_port == 20000 + PORT_BLOCK - 1
        and opts.nats_b_port == 5555
    )
    assert all(20000 <= p < 20000 + PORT_BLOCK for k, p in ports.items() if k != "nats_b_port")
    assert len(set(ports.values())) == len(ports)
    argv = [
        "up",
        "--base-port",
        "20000",
        "--prefill",
        "8",
        "--relay",
        "8",
        "--md",
        "8",
        "--routers",
        "8",
        "--nats-cluster",
        "8",
    ]
    plan = port_plan(cli.up_options(cli.parse_args(argv)[0]))
    assert all(20000 <= p < 20000 + PORT_BLOCK for p in plan.ports())


def test_count_flags(capsys) -> None:
    argv = ["up", "--prefill", "2", "--relay", "3", "--md", "4", "--routers", "5", "--nats-cluster", "6"]
    opts = cli.up_options(cli.parse_args(argv)[0])
    assert (opts.prefill, opts.relay, opts.md, opts.routers, opts.nats_cluster) == (2, 3, 4, 5, 6)
    for bad in (["--md", "0"], ["--routers", "9"], ["--nats-cluster", "-1"]):
        with pytest.raises(SystemExit) as e:
            cli.up_options(cli.parse_args(["up", *bad])[0])
        assert e.value.code == 2
        assert f"pdd up: error: {bad[0]} must be 1..8, got {int(bad[1])}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["up", "--prefill", "two"])


def test_forwarded_and_rejected_arguments() -> None:
    args, extra = cli.parse_args(["wan", "--delay-ms", "5", "--help"])
    assert args.command == "wan" and extra == ["--delay-ms", "5", "--help"]
    args, extra = cli.parse_args(["bench", "e2e", "--requests", "3"])
    assert (args.name, extra) == ("e2e", ["--requests", "3"])
    assert cli.parse_args(["serve", "main_decode"])[0].service == "main_decode"
    for bad in (["serve", "nope"], ["bench", "nope"], ["trace", "x", "--bogus"], ["up", "--bogus"], []):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_trace_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("PDD_TRACE_DIR", str(tmp_path))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    router = tracing.get_tracer("router", "0", "dc-a")
    md = tracing.get_tracer("main_decode", "0", "dc-b")
    with router.start_as_current_span("router.request", attributes={"pdd.request_id": "cmpl-42"}) as root:
        with md.start_as_current_span("md.decode", context=tracing.extract(tracing.inject())):
            pass
    trace_id = f"{root.get_span_context().trace_id:032x}"

    assert cli.main(["trace", "cmpl-42"]) == 0
    text = capsys.readouterr().out
    assert trace_id in text and "dc-a" in text and "dc-b" in text and "md.decode" in text

    assert cli.main(["trace", trace_id, "--dir", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trace_id"] == trace_id and len(data["spans"]) == 2

    assert cli.main(["trace", "cmpl-missing"]) == 1
    assert "no trace" in capsys.readouterr().err


def test_certs_command(tmp_path: Path, capsys) -> None:
    from shared.security.credentials import Credentials

    creds = Credentials(tmp_path / "secrets")
    assert cli.main(["certs", "--workdir", str(tmp_path), "--host", "pdd.example"]) == 0
    assert str(creds.dir) in capsys.readouterr().out
    cert, key = creds.identity("router").cert.read_bytes(), creds.secret_file.read_bytes()
    assert not list(creds.dir.glob("*.nats-password"))  # the certificate is the NATS credential
    assert "pdd.example" in json.loads((creds.dir / "hosts.json").read_text())
    assert not (creds.dir / "nats-a.conf").exists()  # only with --compose
    assert cli.main(["certs", "--workdir", str(tmp_path), "--keep", "--host", "pdd.example"]) == 0
    assert (creds.identity("router").cert.read_bytes(), creds.secret_file.read_bytes()) == (cert, key)
    assert cli.main(["certs", "--workdir", str(tmp_path)]) == 0  # regenerates everything
    assert creds.identity("router").cert.read_bytes() != cert and creds.secret_file.read_bytes() != key
