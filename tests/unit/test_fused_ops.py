"""The fused small ops (RMSNorm with its residual add, RoPE, SiLU x up, KV writes) against the
tensor code they replace, and the engine's greedy tokens with and without them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.config import EngineSettings, ModelSettings
from shared.engine.engine import LLMEngine
from shared.model import load_model
from shared.model.fused import choose_fused_ops, use_fused_ops, why_not_fused
from shared.model.kernels import fused_ops
from shared.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, split_qkv_rope
from tests.unit.test_attention_backends import engine_on, workload

OPS = fused_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16]


def norm_pair(dtype: torch.dtype) -> tuple[RMSNorm, RMSNorm]:
    plain = RMSNorm(96, 1e-6).to(dtype)
    plain.weight.data = torch.randn(96).to(dtype)
    fused = RMSNorm(96, 1e-6).to(dtype)
    fused.weight.data, fused.fused = plain.weight.data, OPS
    return plain, fused


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_residual_add_and_norm_match_the_tensor_code(dtype):
    torch.manual_seed(0)
    tol = 1e-5 if dtype is torch.float32 else 2**-7  # summed in another order: bf16's last bit may differ
    plain, fused = norm_pair(dtype)
    x, residual = torch.randn(37, 96).to(dtype), torch.randn(37, 96).to(dtype)
    want_h, want_r = plain.add_forward(x.clone(), residual.clone())
    got_x, got_r = x.clone(), residual.clone()
    h, r = fused.add_forward(got_x, got_r)
    assert h.data_ptr() == got_x.data_ptr() and r.data_ptr() == got_r.data_ptr()  # in place
    assert torch.equal(r, want_r)  # the add rounds as the tensor add
    torch.testing.assert_close(h, want_h, rtol=tol, atol=tol)  # the norm sums in another order
    before = x.clone()
    torch.testing.assert_close(fused(x), plain(x), rtol=tol, atol=tol)
    assert torch.equal(x, before)  # the plain norm writes a new tensor


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_bit_exact_against_the_tensor_code(dtype):
    class Cfg:
        head_dim, rope_theta, rope_scaling = 32, 10000.0, None

    heads, kv_heads = 6, 2
    qkv = torch.randn(21, (heads + 2 * kv_heads) * 32).to(dtype)
    cos, sin = RotaryEmbedding(Cfg)(torch.arange(21) * 13, dtype)
    want = split_qkv_rope(qkv, cos, sin, heads, kv_heads, 32)
    got = split_qkv_rope(qkv, cos, sin, heads, kv_heads, 32, OPS)
    assert [t.shape for t in got] == [(21, heads, 32), (21, kv_heads, 32), (21, kv_heads, 32)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert got[0].is_contiguous() and got[1].is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_times_up_is_bit_exact_against_the_tensor_code(dtype):
    torch.manual_seed(0)
    plain = SwiGLU(48, 80).to(dtype)
    fused = SwiGLU(48, 80).to(dtype)
    fused.load_state_dict(plain.state_dict())
    fused.fused = OPS
    with torch.no_grad():
        for rows in (1, 7, 300):
            x = torch.randn(rows, 48).to(dtype)
            assert torch.equal(fused(x), plain(x))
        x = torch.randn(2, 3, 48).to(dtype)  # not a flat batch
        assert torch.equal(fused(x), plain(x))
    with pytest.raises(RuntimeError, match="2 I"):
        OPS.silu_mul(torch.randn(3, 7))


@pytest.mark.parametrize("dtype", DTYPES)
def test_helper_threads_give_the_same_bits_as_one_thread_alone(dtype):
    """With one torch thread, low-priority helpers take chunks of rows (a prefill's hundreds):
    each row is computed whole by one thread, so the bits are those of the thread alone; under
    inference mode too (a helper thread starts with the default modes)."""
    torch.manual_seed(0)
    rows, heads, kv_heads, d = 2000, 6, 2, 32
    x, residual = torch.randn(rows, 96).to(dtype), torch.randn(rows, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).to(dtype)
    cos, sin = torch.randn(rows, d).to(dtype), torch.randn(rows, d).to(dtype)
    gate_up = torch.randn(rows, 160).to(dtype)

    def run() -> list[torch.Tensor]:
        x1, r1 = x.clone(), residual.clone()
        OPS.add_rms_norm_(x1, r1, weight, 1e-6)
        with torch.inference_mode():
            silu = OPS.silu_mul(gate_up)
        return [x1, r1, OPS.rms_norm(x, weight, 1e-6), *OPS.rope_qk(qkv, cos, sin, heads, kv_heads), silu]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run()
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(alone[-1], torch.nn.functional.silu(gate) * up)
        OPS.set_helpers(2)
        for _ in range(10):
            assert all(torch.equal(g, w) for g, w in zip(run(), alone, strict=True))
    finally:
        OPS.set_helpers(0)
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_writes_land_where_index_copy_puts_them(dtype):
    torch.manual_seed(0)
    layers, blocks, block, kvh, d = 3, 5, 4, 2, 8
    cache = torch.randn(layers, 2, blocks, block, kvh, d).to(dtype)
    want = cache.clone()
    slots = torch.tensor([19, 0, 7, 12])
    qkv = torch.randn(4, 4 * kvh * d).to(dtype)  # v as the model has it: a view of the packed product
    k, v = torch.randn(4, kvh, d).to(dtype), qkv[:, 2 * kvh * d : 3 * kvh * d].view(4, kvh, d)
    want[1, 0].view(-1, kvh, d).index_copy_(0, slots, k)
    want[1, 1].view(-1, kvh, d).index_copy_(0, slots, v)
    OPS.store_kv(cache, 1, slots, k, v)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        OPS.store_kv(cache, 1, torch.tensor([0, 1, 2, blocks * block]), k, v)
    with pytest.raises(RuntimeError, match="hold the layer"):
        OPS.store_kv(cache, layers, slots, k, v)
    with pytest.raises(RuntimeError, match="each token's row contiguous"):
        OPS.store_kv(cache, 1, slots, k.transpose(1, 2).contiguous().transpose(1, 2), v)
    assert torch.equal(cache, want)  # a refused write wrote nothing


def test_bad_inputs_are_refused_not_misread():
    with pytest.raises(RuntimeError, match="do not match"):
        OPS.rms_norm(torch.randn(3, 8), torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        OPS.add_rms_norm_(torch.randn(8, 3).t(), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="do not match"):
        OPS.rope_qk(torch.randn(2, 40), torch.randn(2, 8), torch.randn(2, 8), 2, 2)
    with pytest.raises(RuntimeError, match="dtype"):
        OPS.rms_norm(torch.randn(3, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)


def test_a_fused_model_gives_the_same_logits():
    model, _, _ = load_model(ModelSettings(preset="tiny"))
    ids = list(range(1, 40))
    logits = model.dense_logits(ids)
    layers = model.config.num_layers
    # per layer two norms, the attention block, its KV writes and the SwiGLU; the final norm
    assert use_fused_ops(model, OPS) == 5 * layers + 1
    torch.testing.assert_close(model.dense_logits(ids), logits, rtol=1e-4, atol=1e-4)


def test_choice_and_fallback(monkeypatch):
    model, _, _ = load_model(ModelSettings(preset="tiny"))
    assert why_not_fused(model) is None
    assert choose_fused_ops(model, "torch") == "torch" and model.model.norm.fused is None
    on_meta = nn.Sequential(RMSNorm(4, 1e-6)).to("meta")
    assert "meta" in why_not_fused(on_meta)
    assert choose_fused_ops(on_meta, "auto") == "torch"  # falls back, with a log line
    with pytest.raises(ValueError, match="cannot run here"):
        choose_fused_ops(on_meta, "fused")
    monkeypatch.setattr("shared.model.kernels.fused_ops", lambda: None)
    assert "did not load" in why_not_fused(model)
    assert choose_fused_ops(model, "auto") == "torch"
    monkeypatch.undo()
    monkeypatch.setenv("PDD_ENGINE__SMALL_OPS", "torch")
    from shared.config import MainDecodeSettings

    assert MainDecodeSettings().engine.small_ops == "torch"
    assert EngineSettings().small_ops == "auto"
    assert LLMEngine(ModelSettings(preset="tiny"), EngineSettings(kv_memory_mb=1)).small_ops == "fused"


def test_engine_greedy_tokens_equal_with_and_without_fusion():
    """Chunked prefill, prefix hits and extends, on both attention paths."""
    for attention in ("paged", "reference"):
        plain = engine_on(attention, max_batched_tokens=64, small_ops="torch")
        fused = engine_on(attention, max_batched_tokens=64)
        assert (plain.small_ops, fused.small_ops) == ("torch", "fused")
        assert workload(fused) == workload(plain)
