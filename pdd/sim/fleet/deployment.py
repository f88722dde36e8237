"""What a simulation deploys: instances per role, each role's chip, and the KV paths.

same-dc: P and D in one DC, KV over the in-DC path, always P→MD (no relay).
naive:   P in dc-a, MD in dc-b, KV over the WAN, always P→MD.
pdd:     P and RLD in dc-a, MD in dc-b; the router's policy picks P→MD or P→RLD→MD.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.sim.fleet.link import IN_DC, LinkSpec
from pdd.sim.hardware.chip import Chip

__all__ = ["IN_DC", "Deployment", "LinkSpec", "RoleSpec", "naive", "pdd", "same_dc"]


@dataclass(frozen=True)
class RoleSpec:
    count: int
    chip: Chip


@dataclass(frozen=True)
class Deployment:
    name: str
    kind: str  # "same-dc" | "naive" | "pdd"
    prefill: RoleSpec
    decode: RoleSpec  # MD (cross-DC) or D (same-dc)
    relay: RoleSpec | None  # pdd only
    wan: LinkSpec  # P→MD KV path (IN_DC for same-dc)
    local: LinkSpec = IN_DC  # P→RLD path

    @property
    def cost_per_hour(self) -> float:
        roles = [self.prefill, self.decode] + ([self.relay] if self.relay else [])
        return sum(r.count * r.chip.price_per_hour for r in roles) + self.wan.price_per_hour


def same_dc(prefill: RoleSpec, decode: RoleSpec, name: str = "same-dc") -> Deployment:
    return Deployment(name, "same-dc", prefill, decode, None, IN_DC)


def naive(prefill: RoleSpec, decode: RoleSpec, wan: LinkSpec, name: str = "naive") -> Deployment:
    return Deployment(name, "naive", prefill, decode, None, wan)


def pdd(prefill: RoleSpec, relay: RoleSpec, decode: RoleSpec, wan: LinkSpec, name: str = "pdd") -> Deployment:
    return Deployment(name, "pdd", prefill, decode, relay, wan)
