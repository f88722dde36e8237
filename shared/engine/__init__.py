"""Paged-KV inference engine: block pool + prefix cache, scheduler, runner, sampling."""

from shared.engine.engine import LLMEngine
from shared.engine.errors import EngineError, InvalidRequestError
from shared.engine.hashing import block_hashes
from shared.engine.outputs import EngineStats, FinishReason, StepOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.seam import BlockFormat, Engine
from shared.engine.sequence import Mode

__all__ = [
    "BlockFormat",
    "Engine",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "InvalidRequestError",
    "LLMEngine",
    "Mode",
    "SamplingParams",
    "StepOutput",
    "block_hashes",
]
