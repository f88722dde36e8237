"""Traces across hosts: each DC writes its own span store (PDD_TRACE_DIR per DC, as on two
machines), and the router's GET /v1/traces still shows the spans of both, gathered over the
bus from dc-b's store. Real service processes (router and prefill on nats-a, main decode on
nats-b), a gatewayed NATS pair with the permission table enforced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from pdd.launch import _credentials_env
from shared.config import ENV_PREFIX
from shared.ports import free_port
from tests.polling import until_async

WAIT_S = 60


def _start(name: str, nats_url: str, dc: str, trace_dir: Path, creds_dir: Path, log: Path, **extra: str):
    p = ENV_PREFIX[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDD_", "OTEL_"))}
    env.update(_credentials_env(name, creds_dir))
    env.update(
        {
            f"{p}NATS_URL": nats_url,
            f"{p}INSTANCE": "0",
            f"{p}DATACENTER": dc,
            "PDD_MODEL__PRESET": "tiny",  # spans are the subject here, not the text: a fast start
            "PDD_ENGINE__KV_MEMORY_MB": "8",
            "PDD_TRACE_DIR": str(trace_dir),
            **{p + k.upper(): v for k, v in extra.items()},
        }
    )
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def _spans_of(directory: Path) -> list[dict]:
    return [json.loads(line) for f in directory.glob("*.jsonl*") for line in f.read_text().splitlines()]


async def _poll(fn, timeout: float = WAIT_S):
    """Until another process's HTTP answer is what `fn` wants."""
    return await until_async(fn, timeout, 0.2)


async def test_router_shows_both_datacenters_from_separate_span_stores(nats_pair, nats_security, tmp_path):
    a, b = nats_pair
    store_a, store_b, creds = tmp_path / "traces-a", tmp_path / "traces-b", nats_security.creds.dir
    port = free_port()
    procs = [
        _start(
            "main_decode",
            b.url,
            "dc-b",
            store_b,
            creds,
            tmp_path / "md.log",
            bulk_address=f"tcp://127.0.0.1:{free_port()}",
        ),
        _start("prefill", a.url, "dc-a", store_a, creds, tmp_path / "prefill.log"),
        # dc-x runs nothing: its silence is reported, bounded by the gather timeout.
        _start(
            "router",
            a.url,
            "dc-a",
            store_a,
            creds,
            tmp_path / "router.log",
            port=str(port),
            trace_datacenters="dc-a,dc-b,dc-x",
            trace_gather_timeout_s="0.5",
        ),
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:

            async def healthy() -> bool:
                try:
                    return (await http.get("/health")).status_code == 200
                except httpx.HTTPError:
                    return False

            await _poll(healthy)
            r = await http.post(
                "/v1/completions",
                json={"prompt": "two hosts", "max_tokens": 4, "temperature": 0, "pdd": {"pipeline": "p-md"}},
            )
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]

            async def both() -> dict | None:
                got = await http.get(f"/v1/traces/{rid}")
                data = got.json() if got.status_code == 200 else {}
                return data if {"dc-a", "dc-b"} <= set(data.get("datacenters", [])) else None

            data = await _poll(both, 20)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)

    names = {s["name"] for s in data["spans"]}
    assert {"router.request", "prefill.compute", "md.decode"} <= names, names
    assert len({s["span_id"] for s in data["spans"]}) == len(data["spans"])  # no duplicates
    # Each store holds only its own DC: the router saw dc-b's spans over the bus alone.
    assert {s["datacenter"] for s in _spans_of(store_a)} == {"dc-a"}
    assert {s["datacenter"] for s in _spans_of(store_b)} == {"dc-b"}
    assert "dc-b/main_decode/0" in data["answered"] and "dc-a/prefill/0" in data["answered"]
    assert data["missing_datacenters"] == ["dc-x"] and data["partial"] is True
