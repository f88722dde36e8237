"""`pdd serve nats`: the config it renders from a DC's bundle and its flags; a bundle of the
other DC, missing flags or a loopback advertise on a wildcard gateway are refused before
nats-server runs."""

from __future__ import annotations

import pytest

from pdd.certs import write_bundle
from pdd.cli import parse_args
from pdd.serve_nats import serve_nats


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-nats")
    return {dc: write_bundle(root / "ca", dc, root / dc) for dc in ("dc-a", "dc-b")}


def serve(*argv: str) -> int:
    return serve_nats(parse_args(["serve", "nats", *argv])[0])


def test_print_config_renders_the_flags(bundles, capsys):
    code = serve(
        "--dc", "dc-b", "--bundle", str(bundles["dc-b"]), "--print-config",
        "--gateway-url", "nats://10.0.0.1:7322", "--advertise", "10.0.0.1:7323",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert 'listen: "0.0.0.0:4223"' in out and 'listen: "0.0.0.0:7223"' in out
    assert '{name: "nats-a", urls: ["nats://10.0.0.1:7322"]}' in out
    assert 'advertise: "10.0.0.1:7323"' in out
    assert 'user: "CN=main_decode,OU=dc-b,O=pdd"' in out and "prefill" not in out


def test_refusals(bundles, capsys):
    assert serve("--dc", "dc-b", "--bundle", str(bundles["dc-a"]), "--print-config") == 2
    assert "bundle of dc-a, not dc-b" in capsys.readouterr().out
    assert serve("--dc", "dc-a", "--bundle", str(bundles["dc-a"]), "--advertise", "127.0.0.1:7323") == 2
    assert "loopback" in capsys.readouterr().out
    assert serve("--dc", "dc-a") == 2
