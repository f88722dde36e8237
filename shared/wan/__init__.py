"""User-space WAN emulator: TCP proxy links with delay, jitter, bandwidth cap and cut."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.wan.control import WanControl
    from shared.wan.emulator import WanEmulator
    from shared.wan.link import WanLink
    from shared.wan.shaper import LinkSettings, Shaper

__all__ = ["LinkSettings", "Shaper", "WanControl", "WanEmulator", "WanLink"]
_MODULE = {
    "LinkSettings": "shaper",
    "Shaper": "shaper",
    "WanControl": "control",
    "WanEmulator": "emulator",
    "WanLink": "link",
}


def __getattr__(name: str) -> Any:
    # Imported on first use: the KV client needs only shared.wan.via, not the emulator's web stack.
    if name not in _MODULE:
        raise AttributeError(f"module 'shared.wan' has no attribute {name!r}")
    return getattr(importlib.import_module(f"shared.wan.{_MODULE[name]}"), name)
