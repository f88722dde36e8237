"""Two datacenters as two hosts: a network namespace each (tests/netns.py), brought up from the
per-DC bundles with the commands of docs/two-datacenters.md and nothing else. DC A runs nats-a,
`pdd wan` (in front of both gateways and of the KV bulk port), prefill, relay and the router;
DC B runs nats-b and two main decoders. Checked: both pipelines give the single engine's
tokens, one trace spans dc-a and dc-b through the router, a killed MD's stream moves to the
other, a forged identity is refused, `pdd check` passes in each DC, and everything goes away."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine
from tests.e2e.test_e2e_faults import body, stream
from tests.e2e.test_e2e_pipelines import prompt_of, ref_tokens
from tests.netns import DC_A_CLIENT_IP, DC_A_IP, DC_B_IP, TwoHosts, skip_reason
from tests.polling import wait_until

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
            "PDD_RELAY_MD_READY_TIMEOUT_S": "5",
            # Paced (a test knob, docs/testing.md): 120 relayed tokens take >= 3 s, while the
            # prompt's KV crosses in ~1 s, so MD takes over on any host.
            "PDD_RELAY_MIN_STEP_S": "0.025",
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
    last = {"seen": ""}
    want = {"prefill", "relay", "main_decode/md-0", "main_decode/md-1"}

    def serving() -> bool:
        for p in hosts.procs.values():
            assert p.popen.poll() is None, f"{p.name} exited:\n{p.text()[-3000:]}"
        try:
            seen = httpx.get(f"{ROUTER}/v1/instances", timeout=3).json()
        except httpx.HTTPError as e:
            last["seen"] = str(e)
            return False
        last["seen"] = str(sorted(seen))
        return want <= {k if k.startswith("main_decode") else k.split("/")[0] for k in seen}

    try:
        wait_until(serving, timeout_s, 1.0)
    except TimeoutError:
        logs = "\n".join(f"--- {p.name}\n{p.text()[-1500:]}" for p in hosts.procs.values())
        raise AssertionError(f"not serving in {timeout_s}s ({last['seen']}):\n{logs}") from None


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
    seen: dict = {}

    def both_dcs() -> bool:  # spans are exported in batches
        t = httpx.get(f"{ROUTER}/v1/traces/{rid}", timeout=10)
        seen.update(t.json() if t.status_code == 200 else {})
        return {"dc-a", "dc-b"} <= set(seen.get("datacenters", []))

    with contextlib.suppress(TimeoutError):
        wait_until(both_dcs, 15, 0.5)
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
    assert "refused:" in done.stdout and "closed the connection after the TLS handshake" in done.stdout
    assert "spiffe://pdd/dc-a/relay is not prefill" in dcs.hosts.procs["md-0"].text()
    assert "kv-sealed" not in done.stdout  # MD said nothing to it (no banner, no key share)


def test_a_killed_md_moves_its_stream_to_the_other(dcs):
    payload = body("p-md", salt=23)
    want = stream(dcs, payload).tokens
    assert len(want) == payload["max_tokens"]

    killed: list[str] = []

    def busy_md() -> str | None:
        view = httpx.get(f"{ROUTER}/v1/instances", timeout=5).json()
        busy = [k.split("/")[1] for k, v in view.items() if k.startswith("main_decode/") and v["held"]]
        return busy[0] if busy else None

    def kill_busy_md() -> None:
        with contextlib.suppress(TimeoutError):  # (then the test says no MD held the stream)
            md = wait_until(busy_md, 3, 0.1)  # the router's view comes from load reports every 0.5 s
            dcs.hosts.kill(md)
            killed.append(md)

    got = stream(dcs, payload, at_token=10, fault=kill_busy_md)
    assert killed, "no main decode held the stream"
    assert got.error is None and got.done and got.tokens == want


ON_THE_BUS = """
import asyncio, sys
from pathlib import Path
import nats
from shared.security import Identity, client_context
a, url, subject = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
tls = client_context(Identity(a / "ca.pem", a / "relay.pem", a / "relay.key"))
async def main():
    errors = []
    async def on_error(e):
        errors.append(e)
    try:
        nc = await nats.connect(url, tls=tls, allow_reconnect=False, connect_timeout=5, error_cb=on_error)
    except Exception as e:
        print("refused:", e)
        return
    await nc.subscribe(subject)
    await nc.flush(5)
    for _ in range(100):  # the server's refusal of the subscription comes asynchronously: 5 s at most
        if errors:
            break
        await asyncio.sleep(0.05)
    print("connected as relay;", "; ".join(map(str, errors)))
    await nc.close()
asyncio.run(main())
"""


def test_a_relay_certificate_posing_as_main_decode_is_refused_on_the_bus(dcs):
    """In DC B nats-b has no user for it at all; in DC A it is the relay, which may not hear MD's
    prepares (the first link a forged MD touches)."""
    prepare = "pdd.md.md-forged.prepare"
    b = dcs.hosts.run(
        "dc-b", [sys.executable, "-c", ON_THE_BUS, str(dcs.a), f"tls://{DC_B_IP}:4223", prepare]
    )
    assert "refused:" in b.stdout and "Authorization Violation" in b.stdout, b.stdout + b.stderr
    a = dcs.hosts.run(
        "dc-a", [sys.executable, "-c", ON_THE_BUS, str(dcs.a), f"tls://{DC_A_IP}:4222", prepare]
    )
    assert (
        "connected as relay" in a.stdout and "permissions violation for subscription" in a.stdout.lower()
    ), a.stdout + a.stderr


def test_main_decode_started_with_the_relay_certificate_exits_naming_both(dcs):
    env = {
        "PDD_MD_TLS_CERT": str(dcs.a / "relay.pem"),
        "PDD_MD_TLS_KEY": str(dcs.a / "relay.key"),
        "PDD_MD_INSTANCE": "md-forged",
        "PDD_MD_BULK_ADDRESS": "tcp://0.0.0.0:7398",
        "PDD_MD_ADVERTISE": f"tcp://{DC_B_IP}:7398",
    }
    argv = [*PDD, "serve", "main_decode", "--env-file", str(dcs.b / "main_decode.env")]
    done = dcs.hosts.run("dc-b", argv, env, timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "wrong role (relay, expected main_decode)" in done.stderr and "spiffe://pdd/dc-a/relay" in done.stderr
    )
    assert "md-forged" not in httpx.get(f"{ROUTER}/v1/instances", timeout=5).text


LISTEN_AS_RELAY = """
import socket, ssl, sys
from pathlib import Path
from shared.security import Identity, server_context
a = Path(sys.argv[1])
ctx = server_context(Identity(a / "ca.pem", a / "relay.pem", a / "relay.key"))
s = socket.create_server((sys.argv[2], int(sys.argv[3])))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    try:
        ctx.wrap_socket(c, server_side=True).close()
    except (OSError, ssl.SSLError):
        c.close()
"""


def test_pdd_check_names_the_wrong_role(dcs):
    """With the relay's certificate as MD's own, and with it at an address MD might advertise."""
    env = {"PDD_MD_TLS_CERT": str(dcs.a / "relay.pem"), "PDD_MD_TLS_KEY": str(dcs.a / "relay.key")}
    own = dcs.hosts.run("dc-b", [*PDD, "check", "--bundle", str(dcs.b)], env, timeout=60)
    assert own.returncode == 1 and "wrong role (relay, expected main_decode)" in own.stdout, own.stdout
    fake = dcs.hosts.start(
        "dc-b", "fake-md", [sys.executable, "-c", LISTEN_AS_RELAY, str(dcs.a), DC_B_IP, "7397"], {}, dcs.root
    )
    try:
        wait_until(lambda: "listening" in fake.text(), 30, 0.2)
        argv = [*PDD, "check", "--bundle", str(dcs.a), "--md-bulk", f"tcp://{DC_B_IP}:7397"]
        done = dcs.hosts.run("dc-a", argv, timeout=60)
        line = next(x for x in done.stdout.splitlines() if "md bulk" in x)
        assert line.startswith("FAIL") and "wrong role (relay, expected main_decode)" in line, done.stdout
        assert "add-host" not in line
    finally:
        dcs.hosts.kill("fake-md")


def test_pdd_checks_probe_is_no_warning_in_main_decodes_log(dcs):
    view = httpx.get(f"{ROUTER}/v1/instances", timeout=5).json()
    md = next(k.split("/")[1] for k in sorted(view) if k.startswith("main_decode/md-"))  # one still alive
    log = dcs.hosts.procs[md]
    before = log.text()
    argv = [*PDD, "check", "--bundle", str(dcs.a), "--md-bulk", f"tcp://{DC_B_IP}:{7400 - int(md[-1])}"]
    done = dcs.hosts.run("dc-a", argv, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    wait_until(lambda: "probe" in log.text()[len(before) :], 5, 0.2)  # noted, at info
    new = log.text()[len(before) :]
    assert not [x for x in new.splitlines() if " WARNING " in x and "kv" in x], new


def test_an_md_whose_kv_address_presents_the_relay_certificate_is_set_aside(dcs, reference):
    """A main decoder that is itself real, but at whose advertised KV address a listener holding
    DC A's relay certificate answers (a hijacked address): prefill refuses it, the router sets it
    aside and moves its requests, which finish exactly on the other MD; it serves none."""
    view = httpx.get(f"{ROUTER}/v1/instances", timeout=5).json()
    alive = {k.split("/")[1] for k in view if k.startswith("main_decode/")}
    free_port = 7399 if "md-1" not in alive else 7400 if "md-0" not in alive else None
    if free_port is None:  # both alive (the kill test did not run): free md-1's port
        dcs.hosts.kill("md-1")
        free_port = 7399
    fake = dcs.hosts.start(
        "dc-b", "relay-at-md-address",
        [sys.executable, "-c", LISTEN_AS_RELAY, str(dcs.a), DC_B_IP, str(free_port)], {}, dcs.root,
    )  # fmt: skip
    env = {
        "PDD_MD_INSTANCE": "md-2",
        "PDD_MD_BULK_ADDRESS": "tcp://0.0.0.0:7396",
        "PDD_MD_ADVERTISE": f"tcp://{DC_B_IP}:{free_port}",  # where the relay's certificate answers
    }
    argv = [*PDD, "serve", "main_decode", "--env-file", str(dcs.b / "main_decode.env")]
    dcs.hosts.start("dc-b", "md-2", argv, env, dcs.root)
    try:
        wait_until(lambda: "listening" in fake.text(), 30, 0.2)
        wait_until(
            lambda: "main_decode/md-2" in httpx.get(f"{ROUTER}/v1/instances", timeout=5).json(), 240, 1
        )
        served: list[str] = []
        for salt in range(40, 52):  # until the router has tried md-2 (and set it aside)
            prompt = prompt_of(60, salt=salt)
            r = complete(prompt, max_tokens=8, ignore_eos=True, pdd={"pipeline": "p-md"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref_tokens(
                reference, prompt, max_tokens=8, ignore_eos=True
            )
            stats = r.json()["pdd"]
            if stats["instances"]["main_decode"] == "md-2":  # only if moved on to a relay: no MD token
                assert stats["md_tokens"] == 0 and stats["instances"]["relay"], stats
            else:
                served.append(stats["instances"]["main_decode"])
            if "set aside" in dcs.hosts.procs["router"].text():
                break
        router_log = dcs.hosts.procs["router"].text()
        assert "main_decode md-2 set aside" in router_log and "is not main_decode" in router_log, router_log[
            -3000:
        ]
        assert served and "md-2" not in served  # every request finished elsewhere, exactly
        aside = httpx.get(f"{ROUTER}/v1/instances", timeout=5).json()["main_decode/md-2"]["set_aside"]
        assert "spiffe://pdd/dc-a/relay is not main_decode" in aside
        for salt in range(60, 63):  # and new requests never go there
            r = complete(prompt_of(60, salt=salt), max_tokens=4, ignore_eos=True, pdd={"pipeline": "p-md"})
            assert r.status_code == 200 and r.json()["pdd"]["instances"]["main_decode"] != "md-2", r.text
    finally:
        dcs.hosts.kill("md-2")
        dcs.hosts.kill("relay-at-md-address")
