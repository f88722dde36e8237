"""Which link gets the WAN KV codec: a main decoder's (WAN) transfers, over TCP even where the
RDMA path is on; never the relay's local path."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.prefill.kv_stream import kv_senders
from shared.config import PrefillSettings
from shared.kv.pool import KVClientPool
from shared.kv.rdma.sender import RdmaSender
from shared.kv.sender import KVSenders
from shared.kv.transfer import TcpSender


def _senders(**settings) -> KVSenders:
    return kv_senders(PrefillSettings(secret="s", instance="0", **settings), None, KVClientPool("s"))


async def test_exact_is_the_default_and_changes_nothing() -> None:
    senders = _senders(kv_transport="rdma")
    assert senders.wan_codec == "exact"
    rdma = senders.open("tcp://md:1", "r", [1, 2])
    assert isinstance(rdma, RdmaSender)
    rdma.close()  # (its offer to MD had started)
    relay = senders.open("unix:///tmp/relay.sock", "r", None)
    assert isinstance(relay, TcpSender) and relay.codec == "exact"


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_lossy_codec_is_the_wan_links_only_and_takes_tcp(transport: str) -> None:
    senders = _senders(kv_transport=transport, wan_kv_codec="int8")
    wan = senders.open("tcp://md:1", "r", [1, 2])
    assert isinstance(wan, TcpSender) and wan.codec == "int8"
    assert senders.open("unix:///tmp/relay.sock", "r", None).codec == "exact"


def test_the_environment_names_the_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDD_PREFILL_WAN_KV_CODEC", "int4")
    assert PrefillSettings(secret="s", instance="0").wan_kv_codec == "int4"
    monkeypatch.setenv("PDD_PREFILL_WAN_KV_CODEC", "zstd")
    with pytest.raises(ValidationError, match="wan_kv_codec"):
        PrefillSettings(secret="s", instance="0")
