"""shared/config.py: common fields from PDD_<FIELD> and PDD_<SERVICE>_<FIELD> (the latter wins),
a service's own fields from PDD_<SERVICE>_<FIELD> only, nested with `__`."""

from __future__ import annotations

import os

import pytest

from shared.config import MainDecodeSettings, PrefillSettings, RelaySettings, RouterSettings

# Each service class, its prefix, and one of its own fields with a value that differs from the default.
SERVICES = [
    (PrefillSettings, "PDD_PREFILL_", "PREFILL_CHUNK", "7"),
    (RelaySettings, "PDD_RELAY_", "CATCHUP_THRESHOLD", "7"),
    (MainDecodeSettings, "PDD_MD_", "BULK_ADDRESS", "tcp://10.0.0.9:1"),
    (RouterSettings, "PDD_ROUTER_", "PORT", "7"),
]
IDS = ["prefill", "relay", "main_decode", "router"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in os.environ:
        if key.startswith("PDD_"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("cls, prefix, own, value", SERVICES, ids=IDS)
def test_common_variables_reach_every_service(cls, prefix, own, value, monkeypatch) -> None:
    monkeypatch.setenv("PDD_NATS_URL", "nats://common:4222")
    monkeypatch.setenv("PDD_SECRET", "s3cret")
    monkeypatch.setenv("PDD_METRICS_HOST", "0.0.0.0")
    s = cls()
    assert (s.nats_url, s.secret, s.metrics_host) == ("nats://common:4222", "s3cret", "0.0.0.0")


@pytest.mark.parametrize("cls, prefix, own, value", SERVICES, ids=IDS)
def test_the_service_variable_wins(cls, prefix, own, value, monkeypatch) -> None:
    monkeypatch.setenv("PDD_NATS_URL", "nats://common:4222")
    monkeypatch.setenv(f"{prefix}NATS_URL", "nats://mine:4222")
    monkeypatch.setenv("PDD_MODEL__PRESET", "small")
    monkeypatch.setenv(f"{prefix}MODEL__PRESET", "tiny")
    s = cls()
    assert (s.nats_url, s.model.preset) == ("nats://mine:4222", "tiny")


@pytest.mark.parametrize("cls, prefix, own, value", SERVICES, ids=IDS)
def test_nested_fields_merge_across_both_prefixes(cls, prefix, own, value, monkeypatch) -> None:
    monkeypatch.setenv("PDD_MODEL__PRESET", "small")
    monkeypatch.setenv("PDD_ENGINE__KV_MEMORY_MB", "8")
    monkeypatch.setenv(f"{prefix}MODEL__SEED", "3")  # one nested field from each prefix
    s = cls()
    assert (s.model.preset, s.model.seed, s.model.device) == ("small", 3, "cpu")
    assert s.engine.kv_memory_mb == 8.0 and s.engine.block_size == 16


@pytest.mark.parametrize("cls, prefix, own, value", SERVICES, ids=IDS)
def test_own_fields_are_read_from_the_service_prefix_only(cls, prefix, own, value, monkeypatch) -> None:
    default = getattr(cls(), own.lower())
    monkeypatch.setenv(f"PDD_{own}", value)  # PDD_<FIELD> is for common fields
    assert getattr(cls(), own.lower()) == default
    monkeypatch.setenv(f"{prefix}{own}", value)
    assert str(getattr(cls(), own.lower())) == value


def test_a_service_field_named_like_another_prefix_is_not_set_by_it(monkeypatch) -> None:
    # PDD_MD_READY_TIMEOUT_S spells PDD_<relay's md_ready_timeout_s>, but that field is the relay's own.
    monkeypatch.setenv("PDD_MD_READY_TIMEOUT_S", "1")
    assert RelaySettings().md_ready_timeout_s == 30.0
    monkeypatch.setenv("PDD_RELAY_MD_READY_TIMEOUT_S", "1")
    assert RelaySettings().md_ready_timeout_s == 1.0


@pytest.mark.parametrize("cls, prefix, own, value", SERVICES, ids=IDS)
def test_another_services_variables_do_not_leak(cls, prefix, own, value, monkeypatch) -> None:
    default = cls().model_dump()
    for _, other, other_own, other_value in SERVICES:
        if other == prefix:
            continue
        monkeypatch.setenv(f"{other}{other_own}", other_value)
        monkeypatch.setenv(f"{other}NATS_URL", "nats://other:4222")
        monkeypatch.setenv(f"{other}MODEL__PRESET", "small")
        monkeypatch.setenv(f"{other}METRICS_HOST", "0.0.0.0")
    assert cls().model_dump() == default
