"""Limits of the router's HTTP front door, read from the environment.

Names (all optional): PDD_ROUTER_API_KEYS and PDD_API_KEY (comma-separated keys; either or
both), PDD_ROUTER_MAX_IN_FLIGHT, PDD_ROUTER_MAX_WAITING, PDD_ROUTER_MAX_WAIT_S,
PDD_ROUTER_MAX_BODY_BYTES, PDD_ROUTER_BODY_TIMEOUT_S.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "PDD_ROUTER_"
COMMON_API_KEY = "PDD_API_KEY"  # keys every router takes, besides its own PDD_ROUTER_API_KEYS


def env_names(field: str) -> tuple[str, ...]:
    """The variables one field is read from (`pdd config show` lists them)."""
    return (PREFIX + field.upper(), *((COMMON_API_KEY,) if field == "api_keys" else ()))


@dataclass(frozen=True)
class HttpSettings:
    api_keys: tuple[str, ...] = ()  # none: the API is open
    max_in_flight: int = 64  # completion requests served at once
    max_waiting: int = 256  # more wait for a slot, in arrival order; beyond that: 429
    max_wait_s: float = 10.0  # longest wait for a slot before a 429
    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0  # to receive the whole request body, else 408

    def __post_init__(self) -> None:
        if min(self.max_in_flight, self.max_body_bytes) < 1 or self.max_waiting < 0:
            raise ValueError(f"router HTTP limits must be positive: {self}")
        if not (self.max_wait_s >= 0 and self.body_timeout_s > 0):
            raise ValueError(f"router HTTP timeouts must be positive: {self}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HttpSettings:
        keys = ",".join(env.get(name, "") for name in env_names("api_keys"))
        limits = {}
        for name, kind in (
            ("max_in_flight", int),
            ("max_waiting", int),
            ("max_wait_s", float),
            ("max_body_bytes", int),
            ("body_timeout_s", float),
        ):
            value = env.get(env_names(name)[0])
            if value is not None:
                limits[name] = kind(value)
        return cls(api_keys=tuple(k.strip() for k in keys.split(",") if k.strip()), **limits)
