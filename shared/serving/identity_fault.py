"""Telling the routers of a KV peer refused for its identity (an instance-level fault: they set
the instance aside), from the refusing side: prefill dialing an MD, a receiver refusing a sender."""

from __future__ import annotations

import logging

from shared.bus import subjects
from shared.bus.connection import publish
from shared.bus.messages import IdentityFault, Role
from shared.kv.refusal import PeerRefused
from shared.security.identity import parse_identity

log = logging.getLogger(__name__)


def fault_of(refused: PeerRefused, role: Role, instance: str, reporter: str) -> IdentityFault:
    """The fault a refusal makes: `instance` as the reporter knows it (the MD it dialed), else
    the one the refused certificate names, if any."""
    if not instance and refused.identity:
        try:
            instance = parse_identity(refused.identity).instance or ""
        except ValueError:
            instance = ""
    return IdentityFault(role, instance, refused.reason, reporter, refused.peer)


async def report(nc, reporter_role: Role, fault: IdentityFault) -> None:
    """Publish it on the reporter's own subject (the routers know who said it from there)."""
    try:
        await publish(nc, subjects.identity_faults(reporter_role.value), fault)
    except Exception as e:  # NATS trouble: the refusal itself stands
        log.warning("could not report the identity fault of %s %s: %r", fault.role, fault.instance, e)
