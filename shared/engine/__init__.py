"""Paged-KV inference engine: block pool + prefix cache, scheduler, runner, sampling."""

from shared.engine.engine import LLMEngine
from shared.engine.errors import EngineError, InvalidRequestError
from shared.engine.hashing import block_hashes
from shared.engine.outputs import StepOutput
from shared.engine.sampling_params import SamplingParams

__all__ = ["EngineError", "InvalidRequestError", "LLMEngine", "SamplingParams", "StepOutput", "block_hashes"]
