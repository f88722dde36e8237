"""Scale-in without failing a request: an instance that is told to leave says so in its
heartbeat at once, refuses new work with an error the router answers by going elsewhere,
finishes the requests it holds (up to its drain timeout, then gives the rest up so the router
moves them), and on SIGTERM exits 0. Real services, tiny engines, a real secured NATS server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.launch import _credentials_env
from services.main_decode.service import MainDecodeService
from services.prefill.service import PrefillService
from services.relay.service import RelayService
from shared.bus import subjects
from shared.bus.connection import RequestError, flushed, publish, request, subscribe
from shared.bus.messages import (
    Abort,
    AbortReason,
    LoadReport,
    Outcome,
    Pipeline,
    PrefillSubmit,
    PrepareReply,
    PrepareRequest,
    ResumeReply,
    ResumeRequest,
    Role,
    SubmitReply,
    TokenEvent,
)
from shared.config import MainDecodeSettings, PrefillSettings, RelaySettings
from tests.engine_util import greedy, make_engine, run_all, tokens_of
from tests.polling import until

PROMPT = [(i * 5 + 3) % 250 for i in range(40)]
WAIT_S = 30  # bound on every wait of the test but a service process's start
START_S = 90  # a fresh interpreter importing torch: tens of seconds on a busy 2-core host


def _md(nc, **kw) -> MainDecodeService:
    return MainDecodeService(
        MainDecodeSettings(bulk_address="tcp://127.0.0.1:0", secret="s", instance="0", **kw),
        nc,
        make_engine(),
    )


async def _queue(nc, subject: str, cls) -> asyncio.Queue:
    got: asyncio.Queue = asyncio.Queue()

    async def on(msg, raw) -> None:
        got.put_nowait(msg)

    await subscribe(nc, subject, cls, on)
    await flushed(nc)
    return got


async def _first(got: asyncio.Queue, accept, timeout_s: float = WAIT_S) -> object:
    async with asyncio.timeout(timeout_s):
        while not accept(msg := await got.get()):
            pass
    return msg


async def _prepare(nc, md: MainDecodeService, rid: str) -> PrepareReply:
    msg = PrepareRequest(rid, PROMPT, greedy(8), md.engine.block_hashes(PROMPT), Pipeline.P_MD, router="r")
    return await request(nc, subjects.md_prepare("0"), msg, PrepareReply, timeout=WAIT_S)


async def test_a_draining_md_refuses_new_work_and_finishes_what_it_holds(nats_server, nats_security) -> None:
    want = make_engine()
    want.add_request("ref", PROMPT, greedy(24))
    reference = tokens_of(run_all(want)["ref"])
    nc = await nats_security.connect(nats_server, "drain-test")
    md = _md(nc)
    await md.start()
    try:
        reports = await _queue(nc, subjects.load("main_decode", "0"), LoadReport)
        tokens = await _queue(nc, subjects.req("streaming", subjects.Req.TOKENS), TokenEvent)
        assert (await _prepare(nc, md, "held")).ok  # waits for KV that only an abort ends
        resume = ResumeRequest("streaming", PROMPT, [], greedy(24))
        assert (
            await request(nc, subjects.resume("main_decode", "0"), resume, ResumeReply, timeout=WAIT_S)
        ).ok
        drain = asyncio.ensure_future(md.drain(WAIT_S))
        await _first(reports, lambda r: r.draining)  # announced
        with pytest.raises(RequestError, match="503"):  # what the router takes elsewhere
            await request(
                nc,
                subjects.resume("main_decode", "0"),
                ResumeRequest("new", PROMPT, [], greedy(4)),
                ResumeReply,
                timeout=WAIT_S,
            )
        with pytest.raises(RequestError, match="leaving"):
            await _prepare(nc, md, "new2")
        got, last = [], None
        while last is None or not last.finished:
            last = await asyncio.wait_for(tokens.get(), WAIT_S)
            got += last.tokens
        assert got == reference and last.outcome is Outcome.LENGTH  # the running request ended whole
        assert not drain.done() and list(md.jobs) == ["held"]  # it still holds one
        await publish(nc, subjects.abort("held", "router"), Abort("held", AbortReason.FINISHED))
        await asyncio.wait_for(drain, WAIT_S)
        assert md.jobs == {}
    finally:
        await md.stop()
        await nc.close()


async def test_what_a_drain_still_holds_at_its_timeout_is_given_up(nats_server, nats_security) -> None:
    nc = await nats_security.connect(nats_server, "drain-timeout-test")
    md = _md(nc)
    await md.start()
    try:
        aborts = await _queue(nc, subjects.abort("stuck", "main_decode"), Abort)
        assert (await _prepare(nc, md, "stuck")).ok
        await asyncio.wait_for(md.drain(0.2), WAIT_S)
        abort = await asyncio.wait_for(aborts.get(), WAIT_S)  # its peers drop it; its router moves it
        assert abort.reason is AbortReason.FAILED and "leaving" in abort.detail and md.jobs == {}
        assert (await md.engine_loop.call(md.engine.stats)).used_blocks == 0
    finally:
        await md.stop()
        await nc.close()


@pytest.mark.parametrize("role", [Role.PREFILL, Role.RELAY])
async def test_an_idle_instance_drains_at_once_then_refuses_work(
    nats_server, nats_security, tmp_path, role
) -> None:
    nc = await nats_security.connect(nats_server, f"drain-{role.value}")
    if role is Role.PREFILL:
        service = PrefillService(PrefillSettings(secret="s", instance="0"), nc, make_engine())
        subject, msg, reply = (
            subjects.prefill_submit_to("0"),
            PrefillSubmit("x", PROMPT, greedy(4), Pipeline.P_MD),
            SubmitReply,
        )
    else:
        service = RelayService(
            RelaySettings(local_address=f"unix://{tmp_path}/r.sock", secret="s", instance="0"),
            nc,
            make_engine(),
        )
        subject, msg, reply = (
            subjects.resume("relay", "0"),
            ResumeRequest("x", PROMPT, [], greedy(4)),
            ResumeReply,
        )
    await service.start()
    try:
        await asyncio.wait_for(service.drain(WAIT_S), WAIT_S)
        with pytest.raises(RequestError, match="503"):
            await request(nc, subject, msg, reply, timeout=WAIT_S)
        assert service.jobs == {}
    finally:
        await service.stop()
        await nc.close()


async def _md_process(nats_server, nats_security, tmp_path) -> tuple[asyncio.subprocess.Process, Path]:
    """A main decode service process on `nats_server`, its output in the returned log file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    env.update(_credentials_env("main_decode", nats_security.creds.dir))
    env.update(
        {
            "PDD_MD_NATS_URL": nats_server.url,
            "PDD_MD_INSTANCE": "0",
            "PDD_MD_BULK_ADDRESS": "tcp://127.0.0.1:0",
            "PDD_MODEL__PRESET": "tiny",  # a fast start: its 30 s wait for a heartbeat is not a model load
            "PDD_MD_ENGINE__KV_MEMORY_MB": "1",
            "PDD_TRACE_DIR": str(tmp_path),
        }
    )
    log = tmp_path / "md.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.main_decode",
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, log


async def test_sigterm_announces_the_drain_and_exits_zero(nats_server, nats_security, tmp_path) -> None:
    nc = await nats_security.connect(nats_server, "sigterm-test")
    reports = await _queue(nc, subjects.load("main_decode", "0"), LoadReport)
    proc, log = await _md_process(nats_server, nats_security, tmp_path)
    try:
        await _first(reports, lambda r: not r.draining, START_S)  # up and heartbeating
        proc.send_signal(signal.SIGTERM)
        await _first(reports, lambda r: r.draining)
        code = await asyncio.wait_for(proc.wait(), WAIT_S)
        assert code == 0, log.read_text()[-2000:]
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), WAIT_S)
        await nc.close()


async def test_sigterm_after_nats_went_away_still_exits_zero_at_once(
    nats_server, nats_security, tmp_path
) -> None:
    """NATS stopped first (a terminal's Ctrl-C reaching it too, or a crash): leaving must not wait
    out flush timeouts, or the supervisor kills the service after its 10 s grace."""
    nc = await nats_security.connect(nats_server, "sigterm-test")
    reports = await _queue(nc, subjects.load("main_decode", "0"), LoadReport)
    proc, log = await _md_process(nats_server, nats_security, tmp_path)
    try:
        await _first(reports, lambda r: not r.draining, START_S)  # up and heartbeating
        await nc.close()
        await nats_server.stop()
        await until(lambda: "nats main_decode-0: disconnected" in log.read_text(), WAIT_S)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 8)
        assert code == 0, log.read_text()[-2000:]
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), WAIT_S)
