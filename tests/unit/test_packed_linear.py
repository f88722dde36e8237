"""Linear layers packed for oneDNN or in the panel kernel's layout: the same products as
nn.Linear, the same state dict, and the engine's choice of backend."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine
from shared.model import load_model
from shared.model.kernels import panel_linear_ops
from shared.model.packed_linear import PackedLinear, can_pack, choose_linear_backend, pack_linears
from shared.model.panel_linear import LARGE_ROWS, PanelLinear

PANEL_OPS = panel_linear_ops()
needs_panels = pytest.mark.skipif(PANEL_OPS is None, reason="the C++ kernels did not build here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_nn_linear_does(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias).to(dtype)
    if (why := can_pack(linear)) is not None:  # oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT
        pytest.skip(why)
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
    assert pack_linears(model) == (0, 2 * 4 + 1)  # qkv, o, gate_up, down per layer, and the LM head
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
    expected = "panel" if PANEL_OPS is not None else "packed"  # fp32: the panels where they load
    assert LLMEngine(ModelSettings(preset="tiny"), EngineSettings(kv_memory_mb=1)).linear_backend == expected
    bf16 = LLMEngine(ModelSettings(preset="tiny", dtype="bfloat16"), EngineSettings(kv_memory_mb=1))
    # bf16: oneDNN's packed weights where this CPU has its bf16 path, else plain torch.
    bf16_packs = can_pack(nn.Linear(4, 4).to(torch.bfloat16)) is None
    assert bf16.linear_backend == ("packed" if bf16_packs else "torch")
    with pytest.raises(ValueError, match="cannot run here"):
        LLMEngine(
            ModelSettings(preset="tiny", dtype="bfloat16"),
            EngineSettings(kv_memory_mb=1, linear_backend="panel"),
        )


@needs_panels
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [96, 40])  # 40: padded to two panels, the padding cut off
def test_panel_linear_computes_what_nn_linear_does(bias, width):
    torch.manual_seed(1)
    linear = nn.Linear(72, width, bias=bias)
    panel = PanelLinear(linear, PANEL_OPS)
    with torch.no_grad():
        for rows in (
            1,
            3,
            8,
            9,
            17,
            129,
            LARGE_ROWS,
        ):  # register tiles of 8 rows and their tails; the plain path
            x = torch.randn(rows, 72)
            torch.testing.assert_close(panel(x), linear(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 5, 72)
        torch.testing.assert_close(panel(x), linear(x), rtol=1e-5, atol=1e-5)
        wide = torch.randn(4, 144)[:, ::2]  # rows with a gap between them, columns strided
        torch.testing.assert_close(panel(wide), linear(wide), rtol=1e-5, atol=1e-5)
    assert torch.equal(panel.weight, linear.weight)
    assert torch.equal(panel.state_dict()["weight"], linear.weight)


@needs_panels
@pytest.mark.parametrize(("threads", "kernel_calls"), [(1, 1), (2, 0)])
def test_a_long_chunk_leaves_the_panels_only_for_a_library_with_threads(threads, kernel_calls):
    """On one torch thread the panels are even with F.linear, and faster where helper threads
    join them; with more threads the library's kernel spreads over them."""

    class Counting:
        calls = 0

        def __getattr__(self, name):
            return getattr(PANEL_OPS, name)

        def panel_linear(self, *args):
            Counting.calls += 1
            return PANEL_OPS.panel_linear(*args)

    linear = nn.Linear(64, 64)
    panel, before = PanelLinear(linear, Counting()), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            x = torch.randn(LARGE_ROWS, 64)
            torch.testing.assert_close(panel(x), linear(x), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)
    assert Counting.calls == kernel_calls


@needs_panels
def test_a_panel_model_keeps_its_state_dict_even_where_a_layer_is_padded():
    model, _, _ = load_model(ModelSettings(preset="tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = list(range(1, 40))
    logits = model.dense_logits(ids)
    panels, onednn = pack_linears(model, PANEL_OPS)
    assert panels == 2 * 4 + 1 and onednn == 0  # the LM head (258 outputs) too, padded to 288
    assert isinstance(model.lm_head, PanelLinear) and model.lm_head.panels.shape[0] * 32 == 288
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    torch.testing.assert_close(model.dense_logits(ids), logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        PANEL_OPS.pack_panels(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="do not match"):
        PANEL_OPS.panel_linear(torch.randn(2, 9), PANEL_OPS.pack_panels(torch.randn(32, 8)), None)


@needs_panels
def test_helper_threads_give_the_same_bits_as_the_caller_alone():
    """Low-priority helpers take chunks of panels: each panel is still computed whole by one
    thread, so the products are bit-identical however the chunks were shared (and to the
    multi-threaded path's); many calls in a row exercise late helpers and job hand-over."""
    torch.manual_seed(1)
    shapes = [(3072, 512), (512, 1536), (64, 512), (32, 40)]
    weights = [torch.randn(n, k) for n, k in shapes]
    panels = [PANEL_OPS.pack_panels(w) for w in weights]
    bias = torch.randn(3072)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        PANEL_OPS.set_helpers(0)
        inputs = [(torch.randn(rows, p.shape[1]), p) for rows in (1, 5, 8, 13, 256) for p in panels]
        alone = [PANEL_OPS.panel_linear(x, p, None) for x, p in inputs]
        with_bias = PANEL_OPS.panel_linear(inputs[0][0], panels[0], bias)
        for helpers in (1, 3):
            PANEL_OPS.set_helpers(helpers)
            for _ in range(20):
                for (x, p), expected in zip(inputs, alone, strict=True):
                    assert torch.equal(PANEL_OPS.panel_linear(x, p, None), expected)
            assert torch.equal(PANEL_OPS.panel_linear(inputs[0][0], panels[0], bias), with_bias)
        torch.set_num_threads(2)  # more torch threads: the OpenMP path, the same bits
        assert all(
            torch.equal(PANEL_OPS.panel_linear(x, p, None), e)
            for (x, p), e in zip(inputs, alone, strict=True)
        )
    finally:
        PANEL_OPS.set_helpers(0)
        torch.set_num_threads(before)


@needs_panels
def test_helper_threads_serve_callers_on_several_threads():
    """Two engine threads (two engines in one process, as in the tests) share the helpers:
    each call waits for its own chunks only and gets its own result."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(2)
    p = PANEL_OPS.pack_panels(torch.randn(1024, 512))
    xs = [torch.randn(8, 512) for _ in range(4)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = [PANEL_OPS.panel_linear(x, p, None) for x in xs]
        PANEL_OPS.set_helpers(1)

        def many(i: int) -> bool:
            return all(torch.equal(PANEL_OPS.panel_linear(xs[i], p, None), expected[i]) for _ in range(200))

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(many, range(4)))
    finally:
        PANEL_OPS.set_helpers(0)
        torch.set_num_threads(before)
