"""shared/advertise.py: an address given to peers is never loopback while its listener expects
peers from other hosts (refused, or a warning when forced); MD, the relay and prefill's RDMA
host apply it before they start; the default instance id."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.main_decode.service import MainDecodeService
from services.prefill.service import PrefillService
from services.relay.service import RelayService
from shared.advertise import host_of, is_loopback, loopback_verdict
from shared.config import MainDecodeSettings, PrefillSettings, RdmaSettings, RelaySettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "advertised, bound, ok, verdict",
    [
        ("tcp://127.0.0.1:7400", "tcp://127.0.0.1:7400", False, "ok"),  # pdd up: all loopback
        ("tcp://127.0.0.1:7400", "tcp://0.0.0.0:7400", False, "refuse"),  # the hostname resolved to loopback
        ("tcp://127.0.1.1:7400", "tcp://[::]:7400", False, "refuse"),  # Debian's 127.0.1.1
        ("tcp://localhost:7400", "tcp://10.0.0.2:7400", False, "refuse"),
        ("tcp://[::1]:7400", "tcp://0.0.0.0:7400", False, "refuse"),
        ("tcp://127.0.0.1:7400", "tcp://0.0.0.0:7400", True, "warn"),  # forced
        ("tcp://10.0.0.2:7400", "tcp://0.0.0.0:7400", False, "ok"),
        ("tcp://md.dc-b.example:7400", "tcp://0.0.0.0:7400", False, "ok"),  # names are the peers' to resolve
        (
            "tcp://10.0.0.9:7401",
            "tcp://127.0.0.1:7400",
            False,
            "ok",
        ),  # a proxy in front of a loopback listener
        ("unix:///run/pdd/relay-0.sock", "unix:///run/pdd/relay-0.sock", False, "ok"),
        ("127.0.0.1", "0.0.0.0", False, "refuse"),  # a bare host (RDMA)
    ],
)
def test_loopback_verdict(advertised: str, bound: str, ok: bool, verdict: str) -> None:
    assert loopback_verdict(advertised, bound, ok) == verdict


def test_hosts_of_addresses() -> None:
    assert [host_of(a) for a in ("tcp://10.0.0.2:1", "tcp://[::1]:1", "[::1]:1", "h:1", "h", "::", "unix:///x")] == [
        "10.0.0.2", "::1", "::1", "h", "h", "::", ""
    ]  # fmt: skip
    assert is_loopback("127.9.9.9") and is_loopback("::1") and is_loopback("LOCALHOST")
    assert not is_loopback("0.0.0.0") and not is_loopback("vm") and not is_loopback("10.0.0.1")


def refused(coro, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        asyncio.run(coro)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_md_refuses_a_wildcard_bind_whose_hostname_is_loopback(monkeypatch, capsys) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")  # /etc/hosts: 127.0.0.1
    settings = MainDecodeSettings(bulk_address="tcp://0.0.0.0:7399")
    err = refused(MainDecodeService.preflight(settings), capsys)
    assert (
        "main_decode: refusing to start" in err
        and "tcp://127.0.0.1:7399" in err
        and "PDD_MD_ADVERTISE" in err
    )
    asyncio.run(
        MainDecodeService.preflight(
            MainDecodeSettings(bulk_address="tcp://0.0.0.0:7399", advertise_address="tcp://10.0.0.2:7399")
        )
    )
    asyncio.run(MainDecodeService.preflight(MainDecodeSettings()))  # the default: loopback both


def test_md_forced_warns(caplog) -> None:
    settings = MainDecodeSettings(
        bulk_address="tcp://0.0.0.0:7399",
        advertise_address="tcp://127.0.0.1:7399",
        advertise_loopback_ok=True,
    )
    with caplog.at_level(logging.WARNING):
        asyncio.run(MainDecodeService.preflight(settings))
    assert "PDD_MD_ADVERTISE_LOOPBACK_OK" in caplog.text and "loopback" in caplog.text


def test_md_rdma_host_and_relay_and_prefill_rdma(monkeypatch, capsys) -> None:
    md = MainDecodeSettings(
        bulk_address="tcp://0.0.0.0:7399", advertise_address="tcp://10.0.0.2:7399", kv_transport="rdma",
        rdma=RdmaSettings(host="127.0.0.1"),
    )  # fmt: skip
    assert "PDD_MD_RDMA__HOST" in refused(MainDecodeService.preflight(md), capsys)
    relay = RelaySettings(local_address="tcp://0.0.0.0:7500", advertise_address="tcp://127.0.0.1:7500")
    assert "PDD_RELAY_ADVERTISE" in refused(RelayService.preflight(relay), capsys)
    asyncio.run(RelayService.preflight(RelaySettings()))  # a unix socket
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    prefill = PrefillSettings(kv_transport="rdma")
    assert "PDD_PREFILL_RDMA__HOST" in refused(PrefillService.preflight(prefill), capsys)
    asyncio.run(
        PrefillService.preflight(PrefillSettings(kv_transport="rdma", rdma=RdmaSettings(host="127.0.0.1")))
    )


def test_md_process_exits_2_with_the_message(tmp_path: Path) -> None:
    env_file = tmp_path / "md.env"
    env_file.write_text("PDD_MD_BULK_ADDRESS=tcp://0.0.0.0:0\nPDD_MD_ADVERTISE=tcp://127.0.0.1:7399\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    argv = [sys.executable, "-m", "pdd.cli", "serve", "main_decode", "--env-file", str(env_file)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert (
        "main_decode: refusing to start: the bulk address tcp://127.0.0.1:7399 is a loopback address"
        in done.stderr
    )


def test_default_instance_ids_differ_between_processes_on_one_host() -> None:
    here = MainDecodeSettings().instance
    assert here == f"{socket.gethostname()}-{os.getpid()}"
    code = "from shared.config import MainDecodeSettings; print(MainDecodeSettings().instance)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    other = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    ).stdout
    assert other.strip().startswith(socket.gethostname() + "-") and other.strip() != here
