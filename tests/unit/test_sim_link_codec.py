"""A simulated line with a lossy KV codec: fewer bytes on the wire, landings later by the
codec's encode and decode time; `pdd sim run --wan-codec` puts it on every cross-DC line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.link import Link, LinkSpec, link_codec
from pdd.sim.studies import run
from shared.kv.codec import CODEC_BYTES_PER_S, bytes_ratio

from .test_sim_run import TINY


def test_link_codec_takes_the_codecs_ratio_and_time() -> None:
    assert link_codec("exact") is None
    c = link_codec("int8", dtype_bytes=2, head_dim=128)
    assert c is not None and c.ratio == pytest.approx(
        bytes_ratio("int8", (1, 2, 1, 16, 1, 128), torch.bfloat16)
    )
    assert 1.9 < c.ratio < 2.0 and c.seconds_per_byte == pytest.approx(1 / CODEC_BYTES_PER_S["int8"])
    assert 3.9 < link_codec("int4", dtype_bytes=2).ratio < 4.0
    with pytest.raises(ValueError, match="unknown KV codec"):
        link_codec("zstd")


def test_a_codec_link_carries_fewer_bytes_and_lands_later_by_the_codec_time() -> None:
    codec = link_codec("int8", dtype_bytes=4, head_dim=64)
    assert codec is not None
    loop, bins = EventLoop(), []
    link = Link(loop, LinkSpec(1e6, 0.05, codec=codec), random.Random(1), bins)
    landed = []
    t = link.send(4_000_000, lambda: landed.append(loop.now), "md0")
    wire = codec.wire_bytes(4_000_000)
    assert t.nbytes == wire < 1_010_000 and link.backlog_to("md0") == wire
    loop.run()
    assert landed == [pytest.approx(wire / 1e6 + 0.05 + 4_000_000 * codec.seconds_per_byte)]
    assert t.sent == wire and sum(bins) == pytest.approx(wire)


def test_sim_run_wan_codec_cuts_the_lines_bytes(tmp_path: Path) -> None:
    def gbps(codec: str) -> float:
        out = tmp_path / f"{codec}.json"
        assert run.main([*TINY, "--deployment", "naive", "--wan-codec", codec, "--out", str(out)]) == 0
        return json.loads(out.read_text())["deployments"][0]["wan_gbps_mean"]

    exact, int8 = gbps("exact"), gbps("int8")
    assert 0 < int8 < exact / 1.8  # 16-bit KV: about half
