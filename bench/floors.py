"""What a decode step must at least cost on this host, and what it costs on each attention
backend. A decode step reads every weight once and, per sequence, its whole KV context:
  weights floor: one read (a sum) over every weight matrix of the model, or a matvec over
                 them, whichever is faster (best of several; all threads, and one thread);
  KV floor:      one read (a sum) over the KV bytes the step attends over, all threads.
Steps are timed at the model runner (metadata, forward, logits) over sequences whose block
tables cover the context; the KV values do not change the cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from shared.engine import LLMEngine, SamplingParams
from shared.engine.block_pool import blocks_for
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Mode, Sequence
from shared.model.attention import AttentionBackend
from shared.model.packed_linear import PackedLinear
from shared.model.panel_linear import PanelLinear

STEPS_PER_TURN = 5  # a backend's best of this many steps per turn: one step (1 x 128: ~4 ms) is noisy


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()  # first-call allocations
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def weights_floor_s(model: nn.Module, repeat: int, threads: int | None = None) -> float:
    mats = weight_matrices(model)
    xs = [torch.randn(w.shape[1], dtype=w.dtype, device=w.device) for w in mats]
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        matvec = best_of(lambda: [torch.mv(w, x) for w, x in zip(mats, xs, strict=True)], repeat)
        return min(matvec, best_of(lambda: [w.sum() for w in mats], repeat))
    finally:
        torch.set_num_threads(before)


def weight_matrices(model: nn.Module) -> list[torch.Tensor]:
    """Every linear layer's weight, in nn.Linear's layout (packed ones unpacked, once)."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear | PackedLinear | PanelLinear)]


def weight_bytes(model: nn.Module) -> int:
    return sum(w.numel() * w.element_size() for w in weight_matrices(model))


@torch.inference_mode()
def kv_floor_s(engine: LLMEngine, num_blocks: int, repeat: int) -> float:
    """One read of num_blocks blocks of every layer's K and V."""
    kv = engine.kv_cache[:, :, :num_blocks]
    return best_of(lambda: kv.sum(), repeat)


def decode_batch(engine: LLMEngine, num_seqs: int, context: int) -> list[ScheduledSeq]:
    """num_seqs sequences with context - 1 tokens computed, each on its own blocks, one new token."""
    per_seq = blocks_for(context, engine.block_size)
    assert num_seqs * per_seq <= engine.pool.num_blocks, "KV pool too small for the floor shapes"
    batch = []
    for i in range(num_seqs):
        ids = [(i * 31 + j * 7) % 256 for j in range(context)]
        seq = Sequence(f"floor{i}", ids, SamplingParams(max_tokens=1), context, Mode.GENERATE, 0, i)
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seq.num_computed_tokens = context - 1
        batch.append(ScheduledSeq(seq, 1))
    return batch


def decode_step_s(engine: LLMEngine, batch: list[ScheduledSeq], repeat: int) -> float:
    want = [True] * len(batch)
    return best_of(lambda: engine.runner.run(batch, want), repeat)


def floor_rows(
    engine: LLMEngine, backends: dict[str, AttentionBackend], shapes: list[tuple[int, int]], repeat: int
) -> dict:
    model = engine.model
    w_all = weights_floor_s(model, repeat)
    w_one = weights_floor_s(model, repeat, threads=1)
    kept = engine.runner.backend
    rows = []
    try:
        for num_seqs, context in shapes:
            batch = decode_batch(engine, num_seqs, context)
            kv_blocks = num_seqs * blocks_for(context, engine.block_size)
            kv_s = kv_floor_s(engine, kv_blocks, repeat)
            floor = w_all + kv_s
            times = {name: float("inf") for name in backends}
            for _ in range(repeat):  # alternate, so both see the same load on a shared machine
                for name, backend in backends.items():
                    engine.runner.backend = backend
                    times[name] = min(times[name], decode_step_s(engine, batch, STEPS_PER_TURN))
            row = {
                "seqs": num_seqs,
                "context": context,
                "kv_bytes": kv_blocks * engine.block_size * engine.kv_bytes_per_token,
                "weights_floor_ms": w_all * 1e3,
                "kv_floor_ms": kv_s * 1e3,
                "floor_ms": floor * 1e3,
                "step_ms": {k: v * 1e3 for k, v in times.items()},
                "x_floor": {k: v / floor for k, v in times.items()},
            }
            if {"reference", "paged"} <= times.keys():
                row["paged_speedup"] = times["reference"] / times["paged"]
            rows.append(row)
    finally:
        engine.runner.backend = kept
    nbytes = weight_bytes(model)  # (unpacks packed weights: once)
    return {
        "weight_bytes": nbytes,
        "weights_floor_ms": w_all * 1e3,
        "weights_floor_1thread_ms": w_one * 1e3,
        "weights_gb_per_s": nbytes / w_all / 1e9,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
