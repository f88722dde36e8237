"""Prefill's two events toward draining, MD's target and the first token, in either order."""

import pytest

from services.prefill.job import MOVES, PrefillState, after_first_token, after_target

S = PrefillState


@pytest.mark.parametrize("first", ["target", "token"])
def test_both_events_in_either_order_end_in_draining(first: str) -> None:
    events = [after_target, after_first_token] if first == "target" else [after_first_token, after_target]
    state = S.PREFILLING
    for event in events:
        moved = event(state)
        assert moved is not None and moved in MOVES[state]
        state = moved
    assert state is S.DRAINING


@pytest.mark.parametrize("state", [S.DRAINING, S.RELEASED])
def test_an_event_after_draining_began_changes_nothing(state: PrefillState) -> None:
    assert after_target(state) is None and after_first_token(state) is None


def test_a_duplicate_event_changes_nothing() -> None:
    assert after_target(S.TARGETED) is None
    assert after_first_token(S.AWAITING_TARGET) is None
