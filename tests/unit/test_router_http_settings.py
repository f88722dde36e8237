"""The router's HTTP limits and API keys, read from the environment."""

from __future__ import annotations

import pytest

from services.router.api.auth import ApiKeys
from services.router.api.http_settings import HttpSettings


def test_defaults_are_bounded_and_open():
    s = HttpSettings.from_env({})
    assert s == HttpSettings()
    assert s.api_keys == () and s.max_in_flight == 64 and s.max_waiting == 256
    assert s.max_body_bytes == 8 << 20 and s.max_wait_s > 0 and s.body_timeout_s > 0


def test_keys_from_both_variables_and_every_limit():
    env = {
        "PDD_ROUTER_API_KEYS": " a, b ,,",
        "PDD_API_KEY": "c",
        "PDD_ROUTER_MAX_IN_FLIGHT": "3",
        "PDD_ROUTER_MAX_WAITING": "0",
        "PDD_ROUTER_MAX_WAIT_S": "1.5",
        "PDD_ROUTER_MAX_BODY_BYTES": "1024",
        "PDD_ROUTER_BODY_TIMEOUT_S": "2",
    }
    assert HttpSettings.from_env(env) == HttpSettings(("a", "b", "c"), 3, 0, 1.5, 1024, 2.0)


@pytest.mark.parametrize(
    "name, value",
    [("MAX_IN_FLIGHT", "0"), ("MAX_WAITING", "-1"), ("BODY_TIMEOUT_S", "0"), ("MAX_BODY_BYTES", "lots")],
)
def test_a_limit_that_bounds_nothing_is_refused(name, value):
    with pytest.raises(ValueError):
        HttpSettings.from_env({f"PDD_ROUTER_{name}": value})


def test_bearer_keys():
    keys = ApiKeys(["k1", "k2"])
    assert keys.allows(b"Bearer k1") and keys.allows(b"bearer  k2 ")
    for bad in (None, b"", b"k1", b"Bearer", b"Bearer k3", b"Basic k1", b"Bearer k1x", b"Bearer \xff"):
        assert not keys.allows(bad), bad
    assert ApiKeys([]).allows(None)  # no keys: open
