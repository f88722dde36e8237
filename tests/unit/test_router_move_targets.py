"""Where moved requests go (FleetView.move_targets over policy.resume_candidates): where the
first new token comes soonest, a burst spread over the decoders, silent instances left out."""

from __future__ import annotations

import time

from services.router.routing.fleet_view import FleetView
from shared.bus.messages import LoadReport, Role
from shared.config import RouterSettings
from shared.engine import block_hashes

PROMPT = list(range(64))  # 4 blocks of 16


def _fleet(quiet_s: float = 0.6) -> FleetView:
    fleet = FleetView(
        RouterSettings(streaming_lost_after_s=quiet_s), model_id="m", block_size=16, kv_bytes_per_token=1024
    )
    for role, instance in ((Role.MAIN_DECODE, "m0"), (Role.MAIN_DECODE, "m1"), (Role.RELAY, "r0")):
        report = LoadReport(role, instance, num_blocks=100, free_blocks=100, address=f"tcp://{instance}:1")
        fleet.registry.update(report)
    return fleet


def test_the_md_holding_the_prompt_recomputes_least_and_a_burst_spills_over() -> None:
    fleet = _fleet()
    hashes = block_hashes(PROMPT, 16, "m")
    fleet.index.apply("m1", hashes, [])  # m1 holds the whole prompt
    targets = fleet.move_targets(PROMPT, hashes, 10, set())
    assert targets[0] == (Role.MAIN_DECODE, "m1", 10)  # only the 10 tokens so far
    assert sorted(targets[1:]) == [(Role.MAIN_DECODE, "m0", 74), (Role.RELAY, "r0", 74)]
    # Two moves already recompute 80 tokens on m1: the next one's first token comes sooner elsewhere.
    queued = {(Role.MAIN_DECODE, "m1"): 80}
    assert fleet.move_targets(PROMPT, hashes, 10, set(), queued)[0] == (Role.MAIN_DECODE, "m0", 74)
    assert fleet.move_targets(PROMPT, hashes, 10, {(Role.MAIN_DECODE, "m0")}, queued)[0][:2] == (
        Role.RELAY,
        "r0",
    )


def test_an_instance_unheard_for_a_moment_is_not_offered_a_move() -> None:
    fleet = _fleet(quiet_s=0.05)
    time.sleep(0.1)  # the stimulus: the instances go unheard past quiet_s
    fleet.registry.update(LoadReport(Role.RELAY, "r0", num_blocks=100, free_blocks=100))
    assert [t[:2] for t in fleet.move_targets(PROMPT, [], 0, set())] == [(Role.RELAY, "r0")]


def test_an_instance_set_aside_is_neither_routed_to_nor_offered_a_move() -> None:
    from services.router.core.set_aside import SetAside
    from shared.bus.messages import IdentityFault

    fleet = _fleet()
    hashes = block_hashes(PROMPT, 16, "m")
    fleet.index.apply("m1", hashes, [])  # m1 would be the best target
    aside = SetAside()
    fleet.set_aside = aside.of
    aside.fault(IdentityFault(Role.MAIN_DECODE, "m1", "wrong role", "p0"), "prefill", "", 0.0)
    targets = {t[:2] for t in fleet.move_targets(PROMPT, hashes, 10, set())}
    assert targets == {(Role.MAIN_DECODE, "m0"), (Role.RELAY, "r0")}
    assert {m.instance for m in fleet.loads(Role.MAIN_DECODE)} == {"m0"}
    assert fleet.route(PROMPT, None)[1] == "m0"  # new requests go to the other MD
