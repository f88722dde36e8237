"""pdd config show: every setting from the settings classes, its variables, default and
current value (with where it came from), secrets masked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdd import cli
from pdd.config_show import MASK, rows
from shared.config import SETTINGS, MainDecodeSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in os.environ:
        if key.startswith("PDD_"):
            monkeypatch.delenv(key)


def by_name(service: str) -> dict:
    table, errors = rows(service)
    assert errors == []
    return {r.setting: r for r in table}


@pytest.mark.parametrize("service", list(SETTINGS))
def test_every_field_and_nested_field_is_listed(service: str) -> None:
    got = by_name(service)
    cls = SETTINGS[service]
    for name in cls.model_fields:
        assert name in got or any(k.startswith(f"{name}.") for k in got), name
    for sub in ("model.preset", "engine.block_size", "rdma.host"):
        assert sub in got
    assert ("http.max_in_flight" in got) == (service == "router")


def test_variables_defaults_and_current_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDD_NATS_URL", "tls://10.0.0.2:4222")
    monkeypatch.setenv("PDD_MD_MODEL__PRESET", "small")
    monkeypatch.setenv("PDD_MD_ADVERTISE_ADDRESS", "tcp://10.0.0.2:7400")  # the older name
    got = by_name("main_decode")
    url = got["nats_url"]
    assert url.env == ("PDD_MD_NATS_URL", "PDD_NATS_URL")
    assert (url.default, url.current, url.source) == (
        "tls://127.0.0.1:4222",
        "tls://10.0.0.2:4222",
        "PDD_NATS_URL",
    )
    preset = got["model.preset"]
    assert preset.env == ("PDD_MD_MODEL__PRESET", "PDD_MODEL__PRESET")
    assert (preset.default, preset.current, preset.source) == ("-", "small", "PDD_MD_MODEL__PRESET")
    assert got["bulk_address"].env == ("PDD_MD_BULK_ADDRESS",)  # MD's own field: no PDD_ name
    assert got["datacenter"].default == "dc-b"  # MD's own default over the common one
    adv = got["advertise_address"]
    assert adv.env == ("PDD_MD_ADVERTISE", "PDD_MD_ADVERTISE_ADDRESS")
    assert (adv.current, adv.source) == ("tcp://10.0.0.2:7400", "PDD_MD_ADVERTISE_ADDRESS")
    assert (
        got["instance"].default == "(hostname-pid)"
        and got["instance"].current == MainDecodeSettings().instance
    )


def test_secrets_are_masked_and_their_files_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDD_ROUTER_SECRET", "hunter2")
    monkeypatch.setenv("PDD_SECRET", "kv-secret")
    monkeypatch.setenv("PDD_API_KEY", "sk-live")
    monkeypatch.setenv("PDD_ROUTER_SECRET_FILE", "/run/pw")
    got = by_name("router")
    assert got["secret"].current == MASK
    assert got["http.api_keys"].current == MASK and got["http.api_keys"].env == (
        "PDD_ROUTER_API_KEYS",
        "PDD_API_KEY",
    )
    assert got["secret_file"].current == "/run/pw"
    text = "\n".join(map(str, got.values()))
    assert "hunter2" not in text and "kv-secret" not in text and "sk-live" not in text


def test_the_command_reads_env_files_and_names_them(tmp_path: Path, capsys) -> None:
    env = tmp_path / "router.env"
    env.write_text("PDD_ROUTER_PORT=8100\nPDD_ROUTER_TLS_CA=ca.pem\nPDD_ROUTER_SECRET=hunter2\n")
    try:
        assert cli.main(["config", "show", "router", "--env-file", str(env)]) == 0
    finally:
        for key in ("PDD_ROUTER_PORT", "PDD_ROUTER_TLS_CA", "PDD_ROUTER_SECRET"):
            os.environ.pop(key, None)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("port "))
    assert line.split()[1:4] == ["PDD_ROUTER_PORT", "8000", "8100"] and str(env) in line
    assert str(tmp_path.resolve() / "ca.pem") in out and "hunter2" not in out


def test_settings_that_do_not_load_exit_2_naming_the_value(monkeypatch, capsys) -> None:
    monkeypatch.setenv("PDD_ROUTER_PORT", "eighty")
    assert cli.main(["config", "show", "router"]) == 2
    out = capsys.readouterr().out
    assert "eighty" in next(x for x in out.splitlines() if x.startswith("port ")) and "error: port" in out


def test_serve_help_points_to_config_show(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "pdd config show SERVICE" in capsys.readouterr().out


@pytest.mark.parametrize("service", ["prefill", "main_decode", "router"])
def test_the_span_store_is_listed_with_where_it_is_set(service: str, monkeypatch) -> None:
    monkeypatch.delenv("PDD_TRACE_DIR", raising=False)
    assert by_name(service)["trace.dir"].current.startswith("(.pdd/traces")
    monkeypatch.setenv("PDD_TRACE_DIR", "/var/lib/pdd/traces-dc-b")
    row = by_name(service)["trace.dir"]
    assert row.env == ("PDD_TRACE_DIR",) and row.current == "/var/lib/pdd/traces-dc-b"
    assert row.source == "PDD_TRACE_DIR"
