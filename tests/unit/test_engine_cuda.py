"""The engine on a CUDA device: the same tokens as on the CPU, and KV that moves between
engines on different devices (P on one kind of chip, decode on another).

Skipped where torch sees no CUDA device (the CPU-only test machines); run on a GPU host."""

from __future__ import annotations

import random

import pytest
import torch

from shared.config import EngineSettings, ModelSettings
from shared.engine import FinishReason, LLMEngine, Mode
from tests.engine_util import dense_greedy, greedy, random_prompt, run_all, tokens_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _engine(device: str, preset: str = "tiny", dtype: str = "float32") -> LLMEngine:
    return LLMEngine(
        ModelSettings(preset=preset, device=device, dtype=dtype), EngineSettings(kv_memory_mb=8.0)
    )


def _batch(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(n))
    outs = run_all(engine)
    return [tokens_of(outs[f"r{i}"]) for i in range(len(prompts))]


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_cuda_greedy_equals_cpu_batched_and_chunked(preset):
    rng = random.Random(40)
    shared = random_prompt(rng, 40)
    prompts = [shared + random_prompt(rng, rng.randint(5, 90)) for _ in range(6)]
    cpu, gpu = _engine("cpu", preset), _engine("cuda", preset)
    assert gpu.device.type == "cuda" and gpu.exchange.kv_cache.device.type == "cuda"
    warm = [shared + random_prompt(rng, 3)]  # the others then take the shared prefix from the cache
    assert _batch(gpu, warm, 2) == _batch(cpu, warm, 2)
    on_gpu = _batch(gpu, prompts, 24)
    assert on_gpu == _batch(cpu, prompts, 24)
    assert on_gpu[0] == dense_greedy(gpu, prompts[0], 24)
    assert gpu.stats().prefix_hit_tokens >= 6 * 32


def test_bf16_on_cuda_batched_equals_its_dense_reference():
    rng = random.Random(41)
    prompts = [random_prompt(rng, rng.randint(20, 120)) for _ in range(4)]
    gpu = _engine("cuda", "small", "bfloat16")
    got = _batch(gpu, prompts, 16)
    assert got == [dense_greedy(gpu, p, 16) for p in prompts]


@pytest.mark.parametrize("p_dev,md_dev", [("cuda", "cpu"), ("cpu", "cuda")])
def test_kv_moves_between_devices_and_decode_continues_exactly(p_dev, md_dev):
    prompt = random_prompt(random.Random(42), 83)
    ref = _batch(_engine("cpu"), [prompt], 30)[0]
    p, md = _engine(p_dev), _engine(md_dev)
    p.add_request("r", prompt, greedy(30), mode=Mode.PREFILL)
    (first,) = run_all(p)["r"]
    assert first.finish_reason is FinishReason.PREFILLED
    hashes = p.computed_block_hashes("r")
    kv = p.exchange.export_blocks(hashes)
    assert kv.device.type == "cpu"  # what goes on the wire is host memory, whatever the chip
    assert md.exchange.import_blocks(hashes, kv, pin="r") == len(hashes)
    md.add_request("r", prompt + [first.token_id], greedy(30), num_prompt_tokens=len(prompt))
    md.exchange.unpin("r")
    assert [first.token_id] + tokens_of(run_all(md)["r"]) == ref
