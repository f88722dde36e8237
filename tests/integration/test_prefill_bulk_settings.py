"""Prefill's split of large KV groups over parallel connections is set from the environment
(PDD_PREFILL_BULK_PARALLEL, PDD_PREFILL_BULK_PARALLEL_MIN_MIB) and reaches its connection pool."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from services.prefill.service import PrefillService
from shared.config import PrefillSettings
from shared.kv.pool import PARALLEL_CONNECTIONS, PARALLEL_MIN_BYTES, KVClientPool
from tests.engine_util import make_engine


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in os.environ:
        if key.startswith("PDD_"):
            monkeypatch.delenv(key)


async def _pool_of(settings: PrefillSettings, nats_server, nats_security) -> KVClientPool:
    nc = await nats_security.connect(nats_server, "prefill-settings")
    try:
        return PrefillService(settings, nc, make_engine()).kv_clients
    finally:
        await nc.close()


async def test_the_defaults_are_the_pools(nats_server, nats_security) -> None:
    pool = await _pool_of(PrefillSettings(secret="s", instance="0"), nats_server, nats_security)
    assert (pool.parallel, pool.parallel_min_bytes) == (PARALLEL_CONNECTIONS, PARALLEL_MIN_BYTES)


async def test_the_environment_reaches_the_pool(nats_server, nats_security, monkeypatch) -> None:
    monkeypatch.setenv("PDD_PREFILL_BULK_PARALLEL", "2")
    monkeypatch.setenv("PDD_PREFILL_BULK_PARALLEL_MIN_MIB", "0.5")
    pool = await _pool_of(PrefillSettings(secret="s", instance="0"), nats_server, nats_security)
    assert (pool.parallel, pool.parallel_min_bytes) == (2, 512 << 10)


@pytest.mark.parametrize(
    "field, value", [("bulk_parallel", 0), ("bulk_parallel", 17), ("bulk_parallel_min_mib", -1)]
)
def test_nonsense_is_refused(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        PrefillSettings(secret="s", instance="0", **{field: value})
