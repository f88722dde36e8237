"""How much of one sequence a forward takes: chunks of `chunk`, within the step's budget, and
no tail shorter than a quarter chunk left for a forward of its own."""

import pytest

from shared.engine.chunking import chunk_size


@pytest.mark.parametrize(
    ("remaining", "budget", "chunk", "want"),
    [
        (1, 2048, 256, 1),  # a decode
        (100, 2048, 256, 100),  # a short prompt, whole
        (1000, 2048, 256, 256),  # a long one, a chunk at a time
        (257, 2048, 256, 257),  # a 1-token tail goes with its chunk
        (281, 2048, 256, 281),  # so does a 25-token one
        (320, 2048, 256, 256),  # a 64-token tail (a quarter chunk) gets a forward of its own
        (257, 200, 256, 200),  # the step's budget first: no tail rule past it
        (257, 256, 256, 256),  # the whole would not fit the budget
        (3000, 2048, 2048, 2048),  # no chunk cap (chunk = budget): the budget splits
    ],
)
def test_chunk_size(remaining, budget, chunk, want):
    assert chunk_size(remaining, budget, chunk) == want
