"""Model shapes beyond dense (MoE, hybrid attention, fp8) and instances of several chips."""

from __future__ import annotations

import pytest

from pdd.sim.hardware.profiles import chip, load_profile, model_spec


def test_moe_counts_active_parameters_for_flops_and_all_of_them_for_memory():
    m = model_spec("qwen3-235b-a22b-fp8")
    assert m.params == pytest.approx(235.1e9, rel=0.002) and m.active_params == pytest.approx(
        22.2e9, rel=0.005
    )
    assert m.weight_bytes == m.params  # fp8 weights
    assert m.kv_bytes_per_token == 2 * 94 * 4 * 128 * 1  # fp8 KV cache
    assert m.flops_per_token == 2 * (m.active_params - m.vocab * m.hidden)


def test_hybrid_attention_keeps_kv_only_in_its_full_attention_layers():
    m = model_spec("qwen3-next-80b-a3b-fp8")
    assert m.attn_layers == 12 and m.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2  # bf16 KV
    assert m.flops_per_attn_pair == 4 * 12 * 16 * 256
    assert m.active_params == pytest.approx(3.2e9, rel=0.02)


def test_an_instance_of_tp_chips_has_their_price_memory_and_a_share_of_each_step():
    m = model_spec("qwen2.5-7b")
    one, two = chip("gpu-a", m), chip("gpu-a", m, 2)
    p = load_profile("gpu-a")
    usable = int(p["memory_bytes"] * p["usable_memory_fraction"])
    assert (two.chips, two.price_per_hour) == (2, 2 * one.price_per_hour)
    assert two.kv_capacity_bytes == 2 * usable - m.weight_bytes
    assert two.step.memory.const == pytest.approx(
        one.step.memory.const / 2
    )  # each chip reads half the weights
    assert two.step.compute.per_attn == pytest.approx(one.step.compute.per_attn / 2)
    allreduce = 2 * m.layers * m.hidden * 2 * 2 * (1 / 2) / p["interconnect_bytes_per_s"]
    assert two.step.compute.per_token == pytest.approx(one.step.compute.per_token / 2 + allreduce)
    assert two.step.overhead_s == pytest.approx(one.step.overhead_s + 2 * m.layers * p["allreduce_latency_s"])


def test_kv_heads_fewer_than_chips_repeat_and_weights_must_fit():
    m = model_spec("qwen3-next-80b-a3b-fp8")  # 2 KV heads
    p = load_profile("gpu-b")
    usable = int(p["memory_bytes"] * p["usable_memory_fraction"])
    assert chip("gpu-b", m, 4).kv_capacity_bytes == (4 * usable - m.weight_bytes) * 2 // 4
    with pytest.raises(ValueError, match="does not fit"):
        chip("gpu-a", m)
    with pytest.raises(ValueError, match="tensor parallel"):
        chip("cpu-calibrated", model_spec("small"), 2)
