"""MD's handoff protocol on a job, no server: which batch is new, stale or a duplicate, and
which one applies next."""

from opentelemetry.context import Context

from services.main_decode.job import Extend, MainDecodeJob, MainDecodeState
from shared.bus.messages import HandoffBatch, HandoffMode, Pipeline, PrepareRequest
from shared.engine import SamplingParams

CTX = Context()  # the sender's trace context a batch is held with


def test_a_batch_is_stale_once_applied_and_a_duplicate_while_held() -> None:
    job = MainDecodeJob(PrepareRequest("r", [1, 2], SamplingParams(), [], Pipeline.P_MD), set())
    job.next_seq = 2
    job.batches[4] = (HandoffBatch("r", 4, 4, [9], final=False, mode=HandoffMode.CATCH_UP), CTX)
    assert [job.redelivery(seq) for seq in (0, 1, 2, 3, 4, 5)] == [
        "stale",
        "stale",
        None,
        None,
        "duplicate",
        None,
    ]


def _batch(seq: int, start: int, tokens: list[int], final: bool = False) -> HandoffBatch:
    return HandoffBatch("r", seq, start, tokens, final=final, mode=HandoffMode.CATCH_UP)


def _ready_job() -> MainDecodeJob:
    job = MainDecodeJob(
        PrepareRequest("r", [1, 2], SamplingParams(), [], Pipeline.P_RLD_MD, relay="rld0"), set()
    )
    job.state.to(MainDecodeState.READY)  # its prompt KV is complete
    return job


def test_batches_apply_in_seq_order_whatever_order_they_arrive_in() -> None:
    job = _ready_job()
    assert job.hold(_batch(1, 3, [7, 8]), CTX) is None
    assert job.next_extend() is None  # seq 0 is still missing
    assert job.hold(_batch(0, 0, [4, 5, 6]), CTX) is None
    first = job.next_extend()
    assert isinstance(first, Extend) and first.batch.seq == 0 and first.first
    assert job.state.is_in(MainDecodeState.EXTENDING) and job.next_extend() is None  # one at a time
    job.extended(first.batch)
    second = job.next_extend()
    assert isinstance(second, Extend) and second.batch.seq == 1 and not second.first
    job.extended(second.batch)
    assert (job.next_seq, job.next_index) == (2, 5) and job.state.is_in(MainDecodeState.READY)
    assert job.hold(_batch(1, 3, [7, 8]), CTX) == "stale"
    assert job.hold(_batch(2, 5, [9], final=True), CTX) is None
    final = job.next_extend()
    assert isinstance(final, Extend)
    job.extended(final.batch)
    assert job.state.is_in(MainDecodeState.DECODING)  # MD decodes on alone


def test_nothing_applies_before_the_prompt_kv_is_complete() -> None:
    job = MainDecodeJob(PrepareRequest("r", [1, 2], SamplingParams(), [], Pipeline.P_MD), {11})
    assert job.hold(_batch(0, 0, [4], final=True), CTX) is None
    assert job.next_extend() is None and 0 in job.batches  # held for later


def test_a_batch_that_does_not_continue_the_output_fails_the_request() -> None:
    job = _ready_job()
    job.hold(_batch(0, 1, [4]), CTX)
    assert job.next_extend() == "handoff batch 0 out of order or empty"
    job = _ready_job()
    job.hold(_batch(0, 0, []), CTX)
    assert job.next_extend() == "handoff batch 0 out of order or empty"
