"""Helpers shared by the model/engine tests: small engines, run-to-completion, references."""

from __future__ import annotations

import random

from shared.config import EngineSettings, ModelSettings
from shared.engine import Engine, LLMEngine, SamplingParams, StepOutput


def make_engine(kv_memory_mb: float = 1.0, **engine_kw) -> LLMEngine:
    return LLMEngine(ModelSettings(preset="tiny"), EngineSettings(kv_memory_mb=kv_memory_mb, **engine_kw))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, list[StepOutput]]:
    """Step until idle; every output, grouped by request."""
    outs: dict[str, list[StepOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
    raise AssertionError("engine did not go idle")


def tokens_of(outs: list[StepOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def dense_greedy(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    """Reference: full-sequence forward per token, no KV cache, no batching."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(engine.model.dense_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]
