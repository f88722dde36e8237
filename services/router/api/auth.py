"""API keys: `Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import hmac


class ApiKeys:
    def __init__(self, keys: tuple[str, ...] | list[str]):
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: bytes | None) -> bool:
        """Whether the raw Authorization header carries one of the keys (always, with no keys)."""
        if not self._keys:
            return True
        scheme, _, given = (authorization or b"").strip().partition(b" ")
        given = given.strip()
        ok = False
        for key in self._keys:  # every key, every time: how long it takes says nothing
            ok |= hmac.compare_digest(key, given)
        return ok and scheme.lower() == b"bearer"
