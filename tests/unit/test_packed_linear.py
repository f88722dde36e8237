"""Linear layers packed for oneDNN: the same products as nn.Linear, the same state dict, and
the engine's choice of backend."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine
from shared.model import load_model
from shared.model.packed_linear import PackedLinear, can_pack, choose_linear_backend, pack_linears


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_nn_linear_does(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    with torch.no_grad():
        for rows in (1, 3, 16, 129):  # skinny decodes to prefill chunks, and a 3-D input
            x = torch.randn(rows, 96, dtype=dtype)
            torch.testing.assert_close(packed(x), linear(x), rtol=tol, atol=tol)
        x = torch.randn(2, 5, 96, dtype=dtype)
        assert packed(x).shape == (2, 5, 80)
        torch.testing.assert_close(packed(x), linear(x), rtol=tol, atol=tol)


def test_the_state_dict_and_weight_unpack_to_nn_linear_layout():
    linear = nn.Linear(32, 48, bias=True)
    packed = PackedLinear(linear)
    assert torch.equal(packed.weight, linear.weight)
    state = packed.state_dict()
    assert list(state) == ["weight", "bias"]
    assert torch.equal(state["weight"], linear.weight) and torch.equal(state["bias"], linear.bias)


def test_a_packed_model_keeps_its_state_dict_and_outputs():
    model, _, _ = load_model(ModelSettings(preset="tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = list(range(1, 40))
    logits = model.dense_logits(ids)
    assert pack_linears(model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert all(not isinstance(m, nn.Linear) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(model.dense_logits(ids), logits, rtol=1e-4, atol=1e-4)


def test_choice_of_backend(monkeypatch):
    model, _, _ = load_model(ModelSettings(preset="tiny"))
    assert can_pack(model) is None
    assert choose_linear_backend(model, "torch") == "torch"
    assert isinstance(model.lm_head, nn.Linear)
    on_meta = nn.Sequential(nn.Linear(4, 4)).to("meta")
    assert "meta" in can_pack(on_meta)
    assert choose_linear_backend(on_meta, "auto") == "torch"  # falls back, with a log line
    with pytest.raises(ValueError, match="cannot run here"):
        choose_linear_backend(on_meta, "packed")
    monkeypatch.setenv("PDD_ENGINE__LINEAR_BACKEND", "torch")
    from shared.config import MainDecodeSettings

    assert MainDecodeSettings().engine.linear_backend == "torch"
    assert EngineSettings().linear_backend == "auto"
    assert LLMEngine(ModelSettings(preset="tiny"), EngineSettings(kv_memory_mb=1)).linear_backend == "packed"
