"""Two datacenters as two hosts: a network namespace each (tests/netns.py), brought up from the
per-DC bundles with the commands of docs/two-datacenters.md and nothing else. DC A runs nats-a,
`pdd wan` (in front of both gateways and of the KV bulk port), prefill, relay and the router;
DC B runs nats-b and two main decoders. Checked: both pipelines give the single engine's
tokens, one trace spans dc-a and dc-b through the router, a killed MD's stream moves to the
other, a forged identity is refused, `pdd check` passes in each DC, and everything goes away."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine
from tests.e2e.test_e2e_faults import body, stream
from tests.e2e.test_e2e_pipelines import prompt_of, ref_tokens
from tests.netns import DC_A_CLIENT_IP, DC_A_IP, DC_B_IP, TwoHosts, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

PRESET = "small"  # slow enough on a CPU that a fault lands mid-stream
PDD = [sys.executable, "-m", "pdd.cli"]
ROUTER = f"http://{DC_A_CLIENT_IP}:8000"


def pdd(*args: str, cwd: Path) -> str:
    import subprocess

    done = subprocess.run([*PDD, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"pdd {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def make_bundles(root: Path) -> tuple[Path, Path]:
    """The procedure's first step, on the machine that keeps the CA."""
    a, b = root / "bundle-dc-a", root / "bundle-dc-b"
    pdd(
        "certs", "bundle", "--workdir", "ca", "--dc", "dc-a", "--out", str(a),
        "--host", DC_A_IP,
        "--env", f"PDD_NATS_URL=tls://{DC_A_IP}:4222",
        "--env", f"PDD_PREFILL_BULK_VIA=tcp://{DC_A_IP}:7401",
        "--env", "PDD_ROUTER_HOST=0.0.0.0",
        "--env", f"PDD_MODEL__PRESET={PRESET}",
        cwd=root,
    )  # fmt: skip
    pdd(
        "certs", "bundle", "--workdir", "ca", "--dc", "dc-b", "--out", str(b),
        "--host", DC_B_IP, "--host", DC_A_IP,  # DC A dials DC B's gateway through its WAN link
        "--env", f"PDD_NATS_URL=tls://{DC_B_IP}:4223",
        "--env", f"PDD_MODEL__PRESET={PRESET}",
        cwd=root,
    )  # fmt: skip
    return a, b


@pytest.fixture(scope="module")
def dcs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-dc")
    a, b = make_bundles(root)
    hosts = TwoHosts(root).up()
    try:
        trace = {
            "dc-a": {"PDD_TRACE_DIR": str(root / "traces-a")},
            "dc-b": {"PDD_TRACE_DIR": str(root / "traces-b")},
        }
        serve = [*PDD, "serve"]
        hosts.start("dc-a", "nats-a", [*serve, "nats", "--dc", "dc-a", "--bundle", str(a),
                    "--gateway-url", f"nats://{DC_A_IP}:7322", "--advertise", f"{DC_A_IP}:7323"], {}, root)  # fmt: skip
        hosts.start("dc-b", "nats-b", [*serve, "nats", "--dc", "dc-b", "--bundle", str(b),
                    "--gateway-url", f"nats://{DC_A_IP}:7323", "--advertise", f"{DC_A_IP}:7322"], {}, root)  # fmt: skip
        hosts.start(
            "dc-a", "wan",
            [*PDD, "wan", "--control", "127.0.0.1:7490", "--delay-ms", "10", "--jitter-ms", "0",
             "--link", f"gw-ab={DC_A_IP}:7322>{DC_B_IP}:7223",
             "--link", f"gw-ba={DC_A_IP}:7323>127.0.0.1:7222",
             "--link", f"bulk={DC_A_IP}:7401>{DC_B_IP}:7399-7400,bandwidth_mbps=80"],
            {}, root,
        )  # fmt: skip
        for i, port in enumerate((7400, 7399)):
            env = {
                **trace["dc-b"],
                "PDD_MD_INSTANCE": f"md-{i}",
                "PDD_MD_BULK_ADDRESS": f"tcp://0.0.0.0:{port}",
                "PDD_MD_ADVERTISE": f"tcp://{DC_B_IP}:{port}",
            }
            hosts.start(
                "dc-b",
                f"md-{i}",
                [*serve, "main_decode", "--env-file", str(b / "main_decode.env")],
                env,
                root,
            )
        relay_env = {
            **trace["dc-a"],
            "PDD_RELAY_LOCAL_ADDRESS": f"unix://{root}/relay.sock",
            "PDD_RELAY_MD_READY_TIMEOUT_S": "3.5",
        }
        hosts.start(
            "dc-a", "prefill", [*serve, "prefill", "--env-file", str(a / "prefill.env")], trace["dc-a"], root
        )
        hosts.start("dc-a", "relay", [*serve, "relay", "--env-file", str(a / "relay.env")], relay_env, root)
        router_env = {**trace["dc-a"], "PDD_ROUTER_TOKEN_TIMEOUT_S": "60"}
        hosts.start(
            "dc-a", "router", [*serve, "router", "--env-file", str(a / "router.env")], router_env, root
        )
        wait_serving(hosts)
        yield SimpleNamespace(hosts=hosts, root=root, a=a, b=b, router_url=ROUTER)
    finally:
        hosts.down()


def wait_serving(hosts: TwoHosts, timeout_s: float = 180) -> None:
    deadline, last = time.monotonic() + timeout_s, ""
    want = {"prefill", "relay", "main_decode/md-0", "main_decode/md-1"}
    while time.monotonic() < deadline:
        for p in hosts.procs.values():
            assert p.popen.poll() is None, f"{p.name} exited:\n{p.text()[-3000:]}"
        try:
            seen = httpx.get(f"{ROUTER}/v1/instances", timeout=3).json()
            roles = {k if k.startswith("main_decode") else k.split("/")[0] for k in seen}
            if want <= roles:
                return
            last = str(sorted(seen))
        except httpx.HTTPError as e:
            last = str(e)
        time.sleep(1)
    logs = "\n".join(f"--- {p.name}\n{p.text()[-1500:]}" for p in hosts.procs.values())
    raise AssertionError(f"not serving in {timeout_s}s ({last}):\n{logs}")


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(ModelSettings(preset=PRESET), EngineSettings(kv_memory_mb=64))


def complete(prompt: list[int], **kw) -> httpx.Response:
    return httpx.post(
        f"{ROUTER}/v1/completions", json={"prompt": prompt, "temperature": 0, **kw}, timeout=120
    )


def test_p_md_across_hosts_matches_and_its_trace_spans_both_dcs(dcs, reference):
    prompt = prompt_of(70, salt=21)
    r = complete(prompt, max_tokens=16, ignore_eos=True, pdd={"pipeline": "p-md"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(
        reference, prompt, max_tokens=16, ignore_eos=True
    )
    rid = r.headers["x-request-id"]
    deadline, seen = time.monotonic() + 15, {}
    while not {"dc-a", "dc-b"} <= set(seen.get("datacenters", [])) and time.monotonic() < deadline:
        time.sleep(0.5)  # spans are exported in batches
        t = httpx.get(f"{ROUTER}/v1/traces/{rid}", timeout=10)
        seen = t.json() if t.status_code == 200 else {}
    assert {"dc-a", "dc-b"} <= set(seen.get("datacenters", [])), seen
    assert {s["datacenter"] for s in seen["spans"]} == {"dc-a", "dc-b"}
    assert "dc-b/main_decode/md-0" in seen["answered"] or "dc-b/main_decode/md-1" in seen["answered"]


def test_p_rld_md_across_hosts_matches(dcs, reference):
    prompt = prompt_of(600, salt=22)
    r = complete(
        prompt, max_tokens=120, ignore_eos=True, pdd={"pipeline": "p-rld-md", "catchup_threshold": 10_000}
    )
    assert r.status_code == 200, r.text
    stats = r.json()["pdd"]
    assert stats["pipeline"] == "p-rld-md" and stats["rld_tokens"] > 0 and stats["md_tokens"] > 0
    assert r.json()["choices"][0]["token_ids"] == ref_tokens(
        reference, prompt, max_tokens=120, ignore_eos=True
    )


def test_check_passes_in_each_dc(dcs):
    for dc, bundle in (("dc-a", dcs.a), ("dc-b", dcs.b)):
        done = dcs.hosts.run(dc, [*PDD, "check", "--bundle", str(bundle)], timeout=60)
        assert done.returncode == 0, f"{dc}:\n{done.stdout}\n{done.stderr}"


FORGED = """
import asyncio, sys
from pathlib import Path
from shared.kv import KVTransferError, open_kv_client
from shared.security import Identity, client_context
a = Path(sys.argv[1])
tls = client_context(Identity(a / "ca.pem", a / "relay.pem", a / "relay.key"), check_hostname=False)
async def main():
    try:
        await open_kv_client(sys.argv[2], None, ssl=tls, peer_roles=("main_decode",))
    except KVTransferError as e:
        print("refused:", e)
        return
    print("accepted")
asyncio.run(main())
"""


def test_a_forged_identity_is_refused(dcs):
    """DC A's relay certificate posing as prefill to DC B's main decode, across the line."""
    done = dcs.hosts.run("dc-a", [sys.executable, "-c", FORGED, str(dcs.a), f"tcp://{DC_B_IP}:7400"])
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "spiffe://pdd/dc-a/relay is not prefill" in done.stdout, done.stdout
    assert "spiffe://pdd/dc-a/relay is not prefill" in dcs.hosts.procs["md-0"].text()


def test_a_killed_md_moves_its_stream_to_the_other(dcs):
    payload = body("p-md", salt=23)
    want = stream(dcs, payload).tokens
    assert len(want) == payload["max_tokens"]

    killed: list[str] = []

    def kill_busy_md() -> None:
        deadline = time.monotonic() + 3  # the router's view comes from load reports every 0.5 s
        while not killed and time.monotonic() < deadline:
            view = httpx.get(f"{ROUTER}/v1/instances", timeout=5).json()
            busy = [k.split("/")[1] for k, v in view.items() if k.startswith("main_decode/") and v["held"]]
            if busy:
                dcs.hosts.kill(busy[0])
                killed.append(busy[0])
            time.sleep(0.1)

    got = stream(dcs, payload, at_token=10, fault=kill_busy_md)
    assert killed, "no main decode held the stream"
    assert got.error is None and got.done and got.tokens == want
