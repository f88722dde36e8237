"""MD's handoff-batch bookkeeping on a job: which seq is new, stale or a duplicate."""

from services.main_decode.job import MDJob
from shared.bus.messages import HandoffBatch, HandoffMode, Pipeline, PrepareRequest
from shared.engine import SamplingParams


def test_a_batch_is_stale_once_applied_and_a_duplicate_while_held() -> None:
    job = MDJob(PrepareRequest("r", [1, 2], SamplingParams(), [], Pipeline.P_MD), set())
    job.next_seq = 2
    job.batches[4] = (HandoffBatch("r", 4, 4, [9], final=False, mode=HandoffMode.CATCH_UP), None)  # type: ignore[assignment]
    assert [job.redelivery(seq) for seq in (0, 1, 2, 3, 4, 5)] == [
        "stale",
        "stale",
        None,
        None,
        "duplicate",
        None,
    ]
