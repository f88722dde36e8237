"""The paged attention kernel against the reference (gather + SDPA): same numbers on decode
batches of mixed lengths, prefill chunks, extends over a cached prefix, GQA shapes and
partial last blocks; and the same greedy tokens through the engine on either backend."""

from __future__ import annotations

import os
import random

import pytest
import torch

from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine, Mode
from shared.model import attention as attention_pkg
from shared.model.attention import Attention, AttentionContext, attention_backend
from shared.model.attention.paged_cpu import DENSE_MIN_TOKENS, PagedCpuBackend
from shared.model.attention.reference import ReferenceBackend
from shared.model.kernels import fused_ops, paged_attention_ops, panel_linear_ops
from tests.engine_util import greedy, random_prompt, run_all, tokens_of

ATOL = 2e-5


def paged() -> PagedCpuBackend:
    ops = paged_attention_ops()
    assert ops is not None, "the paged attention kernel did not build or load (see the log)"
    return PagedCpuBackend(ops)


def step(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """One step over sequences given as (cached tokens, new tokens), decodes first; blocks
    scattered over the pool. Returns the context's fields, the cache and the new q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in seqs]
    need = [-(-t // block_size) for t in lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(1, 2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    slots, starts, taken = [], [0], 0
    for b, ((c, n), k) in enumerate(zip(seqs, need, strict=True)):
        row = order[taken : taken + k]
        taken += k
        tables[b, :k] = torch.tensor(row, dtype=torch.int32)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        starts.append(starts[-1] + n)
    fields = dict(
        slot_mapping=torch.tensor(slots),
        query_start=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decode=sum(1 for _, n in seqs if n == 1),
    )
    t = starts[-1]
    qkv = torch.randn(t, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    return fields, cache, qkv


def attend(backend, fields, cache, qkv, heads: int, kv_heads: int) -> torch.Tensor:
    cache = cache.clone()
    ctx = AttentionContext(kv_cache=cache, backend=backend, **fields)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return Attention(0, heads, kv_heads, qkv.shape[-1])(q, k, v, ctx)


DENSE = DENSE_MIN_TOKENS
CASES = {
    "decodes of mixed lengths": [(0, 1), (4, 1), (15, 1), (16, 1), (31, 1), (99, 1), (250, 1)],
    # Enough decodes (for up to 16 threads) that each takes all its kv heads in one work item;
    # a few decodes among other sequences take one kv head per item.
    "many decodes": [
        (c, 1) for c in (0, 3, 15, 16, 17, 31, 40, 63, 64, 99, 120, 128, 170, 200, 255, 256, 300)
    ]
    * 2,
    "one prefill chunk": [(0, 53)],
    "chunks after a cached prefix": [(32, 40), (37, 9), (5, 2)],
    "decodes, prefill and extends together": [(7, 1), (300, 1), (0, 70), (64, 33), (17, 100)],
    # Fresh chunks long enough for SDPA between and after the kernel's runs (and one just short).
    "long fresh chunks among the rest": [
        (3, 1),
        (0, DENSE + 44),
        (20, 5),
        (0, DENSE + 4),
        (0, DENSE),
        (10, 40),
        (0, DENSE - 1),
        (0, DENSE + 24),
    ],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(8, 4, 64, 16), (4, 4, 16, 16), (8, 1, 32, 8), (12, 4, 128, 16), (32, 2, 64, 1), (6, 2, 80, 5)],
)
def test_paged_equals_reference(case, heads, kv_heads, dim, block_size):
    fields, cache, qkv = step(CASES[case], heads, kv_heads, dim, block_size, seed=len(case) + dim)
    ref = attend(ReferenceBackend(), fields, cache, qkv, heads, kv_heads)
    out = attend(paged(), fields, cache, qkv, heads, kv_heads)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("case", list(CASES))
def test_helper_threads_give_the_same_bits_as_one_thread_alone(case):
    """With one torch thread, low-priority helpers take whole work items: the same bits."""
    heads, kv_heads = 8, 4
    fields, cache, qkv = step(CASES[case], heads, kv_heads, 64, 16, seed=3)
    ops, before = paged_attention_ops(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = attend(paged(), fields, cache, qkv, heads, kv_heads)
        ops.set_helpers(2)
        for _ in range(10):
            assert torch.equal(attend(paged(), fields, cache, qkv, heads, kv_heads), alone)
    finally:
        ops.set_helpers(0)
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["many decodes", "decodes, prefill and extends together"])
def test_half_precision_cache_matches_the_fp32_result(dtype, case):
    heads, kv_heads = 8, 2
    fields, cache, qkv = step(CASES[case], heads, kv_heads, 64, 16, dtype)
    ref = attend(ReferenceBackend(), fields, cache.float(), qkv.float(), heads, kv_heads)
    out = attend(paged(), fields, cache, qkv, heads, kv_heads)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= 2e-2  # the output's own rounding


def test_keys_past_the_context_are_never_read():
    """Slots beyond seq_lens (the rest of a partial last block, block 0 as padding) hold NaN."""
    heads, kv_heads = 4, 2
    fields, cache, qkv = step([(20, 1), (3, 1), (9, 7)], heads, kv_heads, 32, 16)
    written = fields["slot_mapping"]
    visible = torch.zeros(cache.shape[2] * 16, dtype=torch.bool)
    for b, total in enumerate(fields["seq_lens"].tolist()):
        for p in range(total):
            blk = int(fields["block_tables"][b, p // 16])
            visible[blk * 16 + p % 16] = True
    visible[written] = True
    poisoned = cache.clone().view(1, 2, -1, kv_heads, 32)
    poisoned[:, :, ~visible] = float("nan")
    out = attend(paged(), fields, poisoned.view_as(cache), qkv, heads, kv_heads)
    assert torch.isfinite(out).all()
    assert (out - attend(ReferenceBackend(), fields, cache, qkv, heads, kv_heads)).abs().max().item() <= ATOL


def test_selection_and_fallback(monkeypatch):
    assert attention_backend("reference", "cpu").name == "reference"
    assert attention_backend("auto", "cpu").name == "paged"
    assert attention_backend("paged", "meta").name == "reference"  # not a CPU tensor: the reference path
    with pytest.raises(ValueError):
        attention_backend("flash", "cpu")
    monkeypatch.setattr("shared.model.kernels.paged_attention_ops", lambda: None)
    assert attention_pkg.attention_backend("paged", "cpu").name == "reference"


def test_setting_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDD_ENGINE__ATTENTION_BACKEND", "reference")
    from shared.config import MainDecodeSettings

    assert MainDecodeSettings().engine.attention_backend == "reference"
    assert EngineSettings().attention_backend == "auto"


# ---- through the engine ------------------------------------------------------------------
def engine_on(backend: str, linear: str = "auto", **kw) -> LLMEngine:
    engine = LLMEngine(
        ModelSettings(preset="tiny"),
        EngineSettings(kv_memory_mb=2, attention_backend=backend, linear_backend=linear, **kw),
    )
    assert engine.runner.backend.name == backend
    return engine


def workload(engine: LLMEngine) -> dict[str, list[int]]:
    """Chunked prefills, prefix hits (a shared 48-token prefix) and a held request extended
    twice, decoding side by side with mixed context lengths."""
    rng = random.Random(5)
    shared = random_prompt(rng, 48)
    out: dict[str, list[int]] = {}
    engine.add_request("first", shared + random_prompt(rng, 21), greedy(20))
    for rid, toks in run_all(engine).items():
        out[rid] = tokens_of(toks)
    engine.add_request("hit", shared + random_prompt(rng, 5), greedy(30))  # 3 cached blocks
    engine.add_request("long", random_prompt(rng, 150), greedy(25))  # chunks of max_batched_tokens
    engine.add_request("held", random_prompt(rng, 40), greedy(48), mode=Mode.HOLD)
    for rid, toks in run_all(engine).items():
        out.setdefault(rid, []).extend(tokens_of(toks))
    engine.extend("held", random_prompt(rng, 23), final=False)  # one forward over 23 tokens
    run_all(engine)
    engine.extend("held", random_prompt(rng, 9), final=True)
    engine.add_request("hit2", shared + random_prompt(rng, 40), greedy(12))
    for rid, toks in run_all(engine).items():
        out.setdefault(rid, []).extend(tokens_of(toks))
    assert engine.stats().prefix_hit_tokens >= 2 * 48
    return out


def test_engine_greedy_tokens_equal_across_backends():
    ref = workload(engine_on("reference", max_batched_tokens=64))
    out = workload(engine_on("paged", max_batched_tokens=64))
    assert set(out) == {"first", "hit", "long", "held", "hit2"}
    assert out == ref
    assert all(len(v) > 0 for v in out.values())


def test_engine_greedy_tokens_equal_across_linear_backends():
    """The panel kernel (the default for fp32 on the CPU) and oneDNN's packed weights against
    F.linear, on both attention paths."""
    for attention in ("paged", "reference"):
        want = workload(engine_on(attention, "torch", max_batched_tokens=64))
        for linear in ("packed", "auto"):
            engine = engine_on(attention, linear, max_batched_tokens=64)
            assert engine.linear_backend == ("packed" if linear == "packed" else "panel")
            assert workload(engine) == want


def test_engine_greedy_tokens_equal_with_helper_threads():
    """One torch thread joined by the kernels' low-priority helpers (what `pdd up` gives a
    decoder on a machine whose cores it shares): the tokens of the reference engine. The
    three kernel libraries share one pool: two helpers are two threads, not six."""
    want = workload(engine_on("reference", "torch", max_batched_tokens=64))
    before = torch.get_num_threads()
    libs = (paged_attention_ops(), panel_linear_ops(), fused_ops())
    try:
        torch.set_num_threads(1)
        for ops in libs:
            ops.set_helpers(0)
        threads = len(os.listdir("/proc/self/task"))
        engine = engine_on("paged", max_batched_tokens=64, helper_threads=2, helper_nice=0)
        assert len(os.listdir("/proc/self/task")) == threads + 2
        assert workload(engine) == want
    finally:
        for ops in libs:  # per process: none for the next tests
            ops.set_helpers(0)
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="not a helper pool"):  # another capsule: a tensor's
        paged_attention_ops().share_helpers(torch.utils.dlpack.to_dlpack(torch.zeros(1)))
