"""`pdd serve nats`: a DC's server config from its bundle holds only that DC's users, the
gateway's URL and advertised address from the flags; a wrong bundle or a loopback advertise
on a wildcard gateway is refused before nats-server runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.cli import parse_args
from pdd.serve_nats import DcNats, dc_nats_config, serve_nats


def bundle(tmp_path: Path, dc: str, services: list[str]) -> Path:
    d = tmp_path / dc
    d.mkdir()
    (d / "bundle.json").write_text(json.dumps({"dc": dc, "services": services}))
    for s in services:
        (d / f"{s}.nats-password").write_text(f"pw-{s}\n")
    return d


def test_only_the_dcs_own_users_and_the_gateway_from_flags(tmp_path):
    b = bundle(tmp_path, "dc-b", ["main_decode"])
    spec = DcNats("dc-b", "0.0.0.0:4223", "0.0.0.0:7223", ("nats://10.0.0.1:7322",), "10.0.0.1:7323")
    text = dc_nats_config(b, spec)
    assert 'server_name: "nats-b"' in text
    assert '"main_decode"' in text and "pw-main_decode" in text
    assert "prefill" not in text.split("gateway {")[0].split("authorization")[1].split("]")[0]
    assert '{name: "nats-a", urls: ["nats://10.0.0.1:7322"]}' in text
    assert 'advertise: "10.0.0.1:7323"' in text
    assert f'"{(b / "nats-b.pem").resolve()}"' in text  # absolute: the bundle may move


def test_a_bundle_of_the_other_dc_is_refused(tmp_path):
    b = bundle(tmp_path, "dc-a", ["prefill", "relay", "router"])
    with pytest.raises(ValueError, match="bundle of dc-a, not dc-b"):
        dc_nats_config(b, DcNats("dc-b", "0.0.0.0:4223", "0.0.0.0:7223", (), None))


def test_print_config_and_refusals(tmp_path, capsys):
    b = bundle(tmp_path, "dc-a", ["prefill", "relay", "router"])
    args, _ = parse_args(["serve", "nats", "--dc", "dc-a", "--bundle", str(b), "--print-config"])
    assert serve_nats(args) == 0
    out = capsys.readouterr().out
    assert 'listen: "0.0.0.0:4222"' in out and 'listen: "0.0.0.0:7222"' in out
    args, _ = parse_args(
        ["serve", "nats", "--dc", "dc-a", "--bundle", str(b), "--advertise", "127.0.0.1:7323"]
    )
    assert serve_nats(args) == 2
    assert "loopback" in capsys.readouterr().out
    args, _ = parse_args(["serve", "nats", "--dc", "dc-a"])
    assert serve_nats(args) == 2
