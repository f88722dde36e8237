"""`pdd bench engine`'s runs: our engine and Hugging Face's `generate` on the same workloads
(a mixed one, and a batch sweep), each timed, with the KV accounting of ours."""

from __future__ import annotations

import random
import tempfile
import time

import torch

from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine, Mode, SamplingParams
from shared.model.export_hf import save_hf


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_engine(args, kv_tokens: int, max_batched: int) -> LLMEngine:
    probe = LLMEngine(
        ModelSettings(preset=args.preset, dtype=args.dtype, device=args.device),
        EngineSettings(kv_memory_mb=1),
    )
    mb = kv_tokens * 1.1 * probe.kv_bytes_per_token / 2**20 + 1
    del probe
    return LLMEngine(
        ModelSettings(preset=args.preset, dtype=args.dtype, device=args.device),
        EngineSettings(
            kv_memory_mb=mb,
            max_batched_tokens=max_batched,
            max_num_seqs=256,
            max_model_len=8192,
            linear_backend=args.linear_backend,
            small_ops=args.small_ops,
        ),
    )


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                out.setdefault(o.rid, []).append(o.token_id)
    return out


def kv_accounting(engine: LLMEngine) -> dict:
    c = engine.model_config
    expected = 2 * c.num_layers * c.num_kv_heads * c.head_dim * engine.dtype.itemsize
    pool_bytes = engine.kv_cache.numel() * engine.kv_cache.element_size()
    block_bytes = engine.pool.num_blocks * engine.block_size * engine.kv_bytes_per_token
    rng = random.Random(1)
    lens = [rng.randint(1, 100) for _ in range(8)]
    for i, n in enumerate(lens):
        engine.add_request(
            f"kv{i}", [rng.randrange(256) for _ in range(n)], SamplingParams(max_tokens=1), mode=Mode.PREFILL
        )
    _drain(engine)
    used = engine.stats().used_blocks
    rounded = sum(-(-n // engine.block_size) for n in lens)
    for i in range(len(lens)):
        engine.release(f"kv{i}")
    return {
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "expected_2_x_layers_x_kv_heads_x_head_dim_x_dtype_bytes": expected,
        "pool_bytes": pool_bytes,
        "pool_overhead_bytes": pool_bytes - block_bytes,
        "blocks_used_for_8_prompts": used,
        "blocks_by_rounding": rounded,
        "ok": engine.kv_bytes_per_token == expected and pool_bytes == block_bytes and used == rounded,
    }


def run_ours_mixed(engine: LLMEngine, reqs: list[tuple[list[int], int]], device: str) -> tuple[float, dict]:
    engine.exchange.reset_prefix_cache()  # no help from an earlier repetition
    _sync(device)
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(f"m{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    out = _drain(engine)
    _sync(device)
    return time.perf_counter() - t0, out


def _hf_generate(hf, prompts: list[list[int]], new_tokens: int, device: str) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    out = hf.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[:, width:].cpu()


def run_hf_mixed(hf, reqs: list[tuple[list[int], int]], batch: int, device: str) -> tuple[float, dict]:
    out: dict[str, list[int]] = {}
    _sync(device)
    t0 = time.perf_counter()
    for s in range(0, len(reqs), batch):
        group = reqs[s : s + batch]
        gen = _hf_generate(hf, [p for p, _ in group], max(n for _, n in group), device)
        for r, (_, n) in enumerate(group):
            out[f"m{s + r}"] = gen[r, :n].tolist()
    _sync(device)
    return time.perf_counter() - t0, out


def sweep_ours(
    engine: LLMEngine, batch: int, prompt_len: int, steps: int, device: str
) -> tuple[float, float]:
    engine.exchange.reset_prefix_cache()
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(256) for _ in range(prompt_len)]
        engine.add_request(f"s{batch}-{i}", prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    _sync(device)
    t0 = time.perf_counter()
    first = 0
    while first < batch:  # prefill: until every request has its first token
        first += sum(o.index == 0 for o in engine.step())
    _sync(device)
    t1 = time.perf_counter()
    _drain(engine)
    _sync(device)
    t2 = time.perf_counter()
    return batch * prompt_len / (t1 - t0), batch * steps / (t2 - t1)


@torch.inference_mode()
def sweep_hf(hf, batch: int, prompt_len: int, steps: int, device: str) -> tuple[float, float]:
    rng = random.Random(batch)
    prompts = [[rng.randrange(256) for _ in range(prompt_len)] for _ in range(batch)]
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    t0 = time.perf_counter()
    hf(input_ids=ids, use_cache=True)
    _sync(device)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    _hf_generate(hf, prompts, steps + 1, device)
    _sync(device)
    t_decode = max(time.perf_counter() - t0 - t_prefill, 1e-9)
    return batch * prompt_len / t_prefill, batch * steps / t_decode


def workload(args) -> tuple[list[tuple[list[int], int]], tuple, tuple]:
    """The mixed workload's (prompt, output length) pairs and its prompt/output ranges."""
    prompt_range, output_range = ((16, 128), (8, 64)) if args.quick else ((32, 512), (16, 256))
    rng = random.Random(args.seed)
    reqs = [
        ([rng.randrange(256) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(args.requests)
    ]
    return reqs, prompt_range, output_range


def hf_model(engine: LLMEngine, device: str):
    """The same weights loaded by transformers, through a Hugging Face checkpoint directory."""
    from transformers import LlamaForCausalLM as HFLlama

    with tempfile.TemporaryDirectory() as tmp:
        save_hf(engine.model, tmp)
        return HFLlama.from_pretrained(tmp, dtype=engine.dtype).to(device).eval()


def warm_up(engine: LLMEngine, hf, device: str) -> None:
    """First-call allocations of big activations and kernel selection, on both sides."""
    for i in range(8):
        engine.add_request(
            f"warm{i}", [(i + j) % 256 for j in range(256)], SamplingParams(max_tokens=4, ignore_eos=True)
        )
    _drain(engine)
    _hf_generate(hf, [[(i + j) % 256 for j in range(256)] for i in range(8)], 4, device)
