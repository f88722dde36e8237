"""Client of the WAN emulator's control API."""

from __future__ import annotations

from typing import Any

import httpx


class WanControl:
    def __init__(self, base_url: str, *, timeout: float = 5.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    async def get(self) -> dict[str, dict[str, Any]]:
        """{link name: {listen, target, delay_ms, jitter_ms, bandwidth_mbps, cut, cut_mode, bytes_up, ...}}"""
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            r = await http.get(f"{self.base_url}/links")
            r.raise_for_status()
            return r.json()

    async def set(self, name: str, **settings: Any) -> dict[str, Any]:
        """e.g. set("bulk", delay_ms=20, bandwidth_mbps=100), set("bulk", cut=True, cut_mode="blackhole"),
        set("bulk", cut=False), set("bulk", bandwidth_mbps=None) for unlimited. Returns the link state."""
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            r = await http.post(f"{self.base_url}/links/{name}", json=settings)
            r.raise_for_status()
            return r.json()
