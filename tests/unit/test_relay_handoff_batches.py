"""The relay's handoff batches, built from a job's progress and the tokens so far."""

from services.relay.handoff import catchup_batch, final_batch
from services.relay.job import RelayJob
from shared.bus.messages import HandoffMode, RelayReport


def test_catch_up_batches_keep_the_newest_token_for_the_final_one() -> None:
    job = RelayJob("r", catchup_threshold=2)
    first = catchup_batch(job, [10, 11, 12, 13])
    assert (first.seq, first.start_index, first.tokens, first.final) == (0, 0, [10, 11, 12], False)
    second = catchup_batch(job, [10, 11, 12, 13, 14, 15])
    assert (second.seq, second.start_index, second.tokens) == (1, 3, [13, 14])
    assert (job.handed, job.seq) == (5, 2)
    job.mode = HandoffMode.CATCH_UP
    last, report = final_batch(job, [10, 11, 12, 13, 14, 15, 16])
    assert (last.seq, last.start_index, last.tokens, last.final, last.mode) == (
        2,
        5,
        [15, 16],
        True,
        HandoffMode.CATCH_UP,
    )
    assert report == RelayReport(
        handed_over=True, rld_tokens=6, handoff_mode=HandoffMode.CATCH_UP, handoff_batches=3
    )


def test_a_one_shot_handoff_is_one_final_batch_of_everything() -> None:
    job = RelayJob("r", catchup_threshold=2)
    batch, report = final_batch(job, [7])
    assert (batch.seq, batch.start_index, batch.tokens, batch.mode) == (0, 0, [7], HandoffMode.ONE_SHOT)
    assert (report.rld_tokens, report.handoff_batches, report.handoff_mode) == (0, 1, HandoffMode.ONE_SHOT)
