"""User-space WAN emulator: TCP proxy links with delay, jitter, bandwidth cap and cut."""

from shared.wan.control import WanControl
from shared.wan.emulator import WanEmulator
from shared.wan.link import WanLink
from shared.wan.shaper import LinkSettings, Shaper

__all__ = ["LinkSettings", "Shaper", "WanControl", "WanEmulator", "WanLink"]
