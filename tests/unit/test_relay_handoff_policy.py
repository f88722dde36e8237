"""The relay's handoff policy: one-shot or catch-up, and when catch-up sends its last batch."""

from services.relay.handoff_policy import catchup_batch_size, catchup_is_final, choose_handoff_mode

# Mode values as they appear on the wire and in responses (pdd.handoff_mode).
ONE_SHOT = "one-shot"
CATCH_UP = "catch-up"


def test_handoff_mode_by_pending_and_load():
    assert choose_handoff_mode(pending=100, relay_running=1, threshold=64, busy_at=4) == CATCH_UP
    assert choose_handoff_mode(pending=100, relay_running=4, threshold=64, busy_at=4) == ONE_SHOT
    assert choose_handoff_mode(pending=64, relay_running=0, threshold=64, busy_at=4) == ONE_SHOT
    assert choose_handoff_mode(pending=65, relay_running=3, threshold=64, busy_at=4) == CATCH_UP


def test_catchup_terminates():
    assert catchup_is_final(pending=10, rounds_done=1, threshold=64, max_rounds=4)
    assert not catchup_is_final(pending=100, rounds_done=1, threshold=64, max_rounds=4)
    assert catchup_is_final(pending=100, rounds_done=4, threshold=64, max_rounds=4)


def test_catchup_final_at_exactly_the_threshold():
    # A remainder of exactly `threshold` tokens is small enough: the same bound that makes
    # choose_handoff_mode pick one-shot for it up front.
    assert catchup_is_final(pending=64, rounds_done=1, threshold=64, max_rounds=4)
    assert not catchup_is_final(pending=65, rounds_done=1, threshold=64, max_rounds=4)
    assert not catchup_is_final(pending=65, rounds_done=3, threshold=64, max_rounds=4)


def test_a_catchup_batch_keeps_the_newest_token_back():
    assert catchup_batch_size(produced=100, handed=0) == 99
    assert catchup_batch_size(produced=100, handed=90) == 9
    assert catchup_batch_size(produced=100, handed=99) == 0  # nothing to send but the final token
