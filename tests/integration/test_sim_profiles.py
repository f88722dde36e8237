"""Model shapes, hardware profiles, the roofline step cost, the calibration fit and `pdd sim`'s
command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.cli import main as pdd_main
from pdd.sim import cli as sim_cli
from pdd.sim.hardware import calibrate
from pdd.sim.hardware.profiles import (
    BUILTIN_PROFILES,
    FIGURES,
    MODELS_DIR,
    chip,
    load_profile,
    model_names,
    model_spec,
    profile_names,
    step_cost_from_json,
)
from pdd.sim.hardware.step_cost import Linear, StepCost, chunk_load, decode_load

ROOT = Path(__file__).resolve().parents[2]


def test_llama_8b_shape_from_its_config():
    spec = model_spec("llama-3.1-8b")
    assert spec.params == 8_029_995_008  # the 8.03 B of the model card
    assert spec.kv_bytes_per_token == 131072  # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert spec.dtype_bytes == 2


def test_presets_are_read_from_the_engine_in_fp32():
    small = model_spec("small")
    assert (small.layers, small.hidden, small.vocab, small.dtype_bytes) == (8, 512, 258, 4)
    assert small.kv_bytes_per_token == 16384  # 8 layers x 4 KV heads x 64 dims x K,V x 4 B
    assert model_spec("small", dtype="bfloat16").kv_bytes_per_token == 8192
    assert {"tiny", "small", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-32b"} <= set(model_names())


def test_the_served_default_model_counts_its_tied_embedding_once():
    spec = model_spec("default")  # SmolLM2-135M-Instruct, read from the GGUF's metadata
    assert (spec.layers, spec.hidden, spec.vocab, spec.tied_embeddings) == (30, 576, 49152, True)
    assert spec.params == 134_479_872  # the model card's 135 M: one 49152 x 576 matrix, not two
    # ...but its lm_head still computes: one token's FLOPs cover the layers and one vocab projection
    assert spec.flops_per_token == 2 * spec.params and spec.kv_bytes_per_token == 46080
    assert "default" in model_names()


def test_roofline_decode_step_by_hand():
    # h100-sxm: 989e12 FLOP/s x 0.6, 3.35e12 B/s x 0.8, 2 ms overhead; llama-3.1-8b in bf16.
    step = chip("h100-sxm", model_spec("llama-3.1-8b")).step
    flops = (
        8 * 15_009_316_864 + (8000 + 8) * 524_288
    )  # 2 x matrix params per token, 4 x 32 x 32 x 128 per pair
    memory = 16_059_990_016 + 131072 * (8000 + 8)  # all weights + KV read and written
    compute_s, memory_s = flops / (989e12 * 0.6), memory / (3.35e12 * 0.8)
    assert memory_s > compute_s  # decode is bandwidth-bound
    assert step.step_s(decode_load(8, 8000)) == pytest.approx(0.002 + memory_s, rel=1e-12)


def test_roofline_prefill_chunk_by_hand():
    step = chip("h100-sxm", model_spec("llama-3.1-8b")).step
    load = chunk_load(2048, 1024)  # 2048 new tokens after 1024 cached
    pairs = 2048 * 1024 + 2048 * 2049 // 2
    compute_s = (2048 * 15_009_316_864 + pairs * 524_288) / (989e12 * 0.6)
    memory_s = (16_059_990_016 + 131072 * (1024 + 2048)) / (3.35e12 * 0.8)
    assert compute_s > memory_s  # a long prefill chunk is compute-bound
    assert step.step_s(load) == pytest.approx(0.002 + compute_s, rel=1e-12)


def test_a_mixed_step_by_hand():
    """Two chunks beside 8 decoding sequences: one step whose load is the sum of its parts."""
    step = chip("h100-sxm", model_spec("llama-3.1-8b")).step
    tokens = 8 + 512 + 64  # a token per decoding sequence, then the chunks' new tokens
    pairs = (8000 + 8) + (512 * 0 + 512 * 513 // 2) + (64 * 3000 + 64 * 65 // 2)
    kv_read = 8000 + 0 + 3000
    compute_s = (tokens * 15_009_316_864 + pairs * 524_288) / (989e12 * 0.6)
    memory_s = (16_059_990_016 + 131072 * (kv_read + tokens)) / (3.35e12 * 0.8)
    assert step.chunks_s([(512, 0), (64, 3000)], 8, 8000) == pytest.approx(0.002 + compute_s, rel=1e-12)
    assert compute_s > memory_s
    # A short extend beside long decodes: bandwidth-bound, so the chunk's context read counts.
    tokens, kv_read = 64 + 16, 64 * 8000 + 20_000
    pairs = (64 * 8000 + 64) + (16 * 20_000 + 16 * 17 // 2)
    compute_s = (tokens * 15_009_316_864 + pairs * 524_288) / (989e12 * 0.6)
    memory_s = (16_059_990_016 + 131072 * (kv_read + tokens)) / (3.35e12 * 0.8)
    assert memory_s > compute_s
    assert step.chunks_s([(16, 20_000)], 64, 64 * 8000) == pytest.approx(0.002 + memory_s, rel=1e-12)
    assert step.chunks_s([], 8, 8000) == step.step_s(decode_load(8, 8000))


def test_kv_capacity_is_usable_memory_less_weights():
    assert chip("h100-sxm", model_spec("llama-3.1-8b")).kv_capacity_bytes == int(80e9 * 0.9) - 16_059_990_016
    assert chip("h200-sxm", model_spec("qwen2.5-32b")).kv_capacity_bytes == int(141e9 * 0.9) - 65_525_514_240
    with pytest.raises(ValueError, match="does not fit"):
        chip("h200-sxm", model_spec("llama-3.1-70b"))  # 141.1 GB of bf16 weights


def test_calibrated_profile_serves_only_its_model():
    profile = load_profile("cpu-calibrated")
    fitted = model_spec(profile["model"]["name"], profile["model"]["dtype"])
    assert chip("cpu-calibrated", fitted).step.step_s(decode_load(1, 100)) > 0
    with pytest.raises(ValueError, match="calibrated for model 'small'"):
        chip("cpu-calibrated", model_spec("llama-3.1-8b"))
    with pytest.raises(ValueError, match="calibrated for"):
        chip("cpu-calibrated", model_spec("small", dtype="bfloat16"))  # same shape, other dtype


def _figure_ok(value) -> bool:
    if isinstance(value, dict):  # a calibrated step cost
        return all(_figure_ok(v) for v in value.values())
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


@pytest.mark.parametrize("path", sorted(BUILTIN_PROFILES.glob("*.json")), ids=lambda p: p.stem)
def test_every_profile_figure_names_its_source(path):
    profile = json.loads(path.read_text())
    for figure in FIGURES[profile["kind"]]:
        assert _figure_ok(profile[figure]), figure
        source = profile["sources"].get(figure, "")
        assert isinstance(source, str) and len(source) > 10, f"{path.name}: no source for {figure}"


def test_every_model_file_names_its_config():
    for path in MODELS_DIR.glob("*.json"):
        assert json.loads(path.read_text())["source"].startswith("https://huggingface.co/"), path.name


def test_expected_profiles_ship():
    assert {"h100-sxm", "h200-sxm", "a100-80gb", "l40s", "gpu-a", "gpu-b", "cpu-calibrated"} <= set(
        profile_names()
    )


def test_user_profiles_win_over_builtin(tmp_path, monkeypatch):
    mine = json.loads((BUILTIN_PROFILES / "h100-sxm.json").read_text()) | {"price_per_hour": 1.25}
    (tmp_path / "h100-sxm.json").write_text(json.dumps(mine))
    monkeypatch.setenv("PDD_SIM_PROFILES", str(tmp_path))
    assert chip("h100-sxm", model_spec("llama-3.1-8b")).price_per_hour == 1.25


def test_fit_recovers_known_coefficients():
    truth = StepCost(2e-3, Linear(per_token=4e-5, per_attn=3e-9, per_kv_read=7e-8, per_seq=2e-4), Linear())
    loads = [decode_load(b, b * c) for b in (1, 4, 16) for c in (64, 512, 1024)]
    loads += [chunk_load(n, c) for n in (32, 128, 512) for c in (0, 512, 1024)]
    fitted = calibrate.fit_step_cost(loads, [truth.step_s(x) for x in loads])
    assert fitted.overhead_s == pytest.approx(truth.overhead_s, rel=1e-6)
    for name in ("per_token", "per_attn", "per_kv_read", "per_seq"):
        assert getattr(fitted.compute, name) == pytest.approx(getattr(truth.compute, name), rel=1e-6), name
    assert fitted.memory == Linear()


def test_fit_reproduces_two_regimes():
    # Steps that turn memory-bound past ~4k KV tokens: max(compute, memory) of two lines.
    truth = StepCost(
        1e-3,
        Linear(const=0.01, per_token=4e-5, per_attn=3e-9, per_kv_read=1e-7, per_seq=2e-4),
        Linear(per_kv_read=4e-6),
    )
    loads = [decode_load(b, b * c) for b in (1, 4, 8, 16) for c in (64, 512, 1536, 3072)]
    loads += [chunk_load(n, c) for n in (16, 128, 512) for c in (0, 1024, 2048)]
    seconds = [truth.step_s(x) for x in loads]
    assert sum(truth.memory(x) > truth.compute(x) for x in loads) >= 5
    fitted = calibrate.fit_step_cost(loads, seconds)
    assert [fitted.step_s(x) for x in loads] == pytest.approx(seconds, rel=1e-6)


def test_nnls_keeps_coefficients_non_negative():
    import numpy as np

    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = calibrate.nnls(a, np.array([2.0, -1.0, 1.0]))  # unconstrained least squares: (2, -1)
    assert x == pytest.approx([1.5, 0.0])


def test_calibrate_quick_writes_a_loadable_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDD_SIM_PROFILES", str(tmp_path))
    assert calibrate.main(["--quick", "--preset", "tiny", "--out", "here", "--quiet"]) == 0
    assert "median |error|" in capsys.readouterr().out
    profile = json.loads((tmp_path / "here.json").read_text())
    assert profile["model"] == {
        "name": "tiny",
        "dtype": "float32",
        "device": "cpu",
        "threads": profile["model"]["threads"],
    }
    assert len(profile["points"]) == 8 and all(p["measured_s"] > 0 for p in profile["points"])
    assert "here" in profile_names()
    assert chip("here", model_spec("tiny")).step.step_s(chunk_load(64, 0)) > 0
    assert 0.0 <= profile["machine"]["background_cores"] <= os.cpu_count()  # what it was timed beside


def test_calibration_background_is_the_others_cpu():
    assert calibrate.background_cores(host_busy_s=30.0, own_cpu_s=10.0, wall_s=10.0) == 2.0
    assert (
        calibrate.background_cores(5.0, 10.0, 10.0) == 0.0
        and calibrate.background_cores(5.0, 1.0, 0.0) == 0.0
    )


def test_pdd_sim_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        pdd_main(["sim", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in sim_cli.COMMANDS)
    with pytest.raises(SystemExit):
        pdd_main(["sim", "calibrate", "--help"])
    assert "--quick" in capsys.readouterr().out


def test_a_missing_command_module_is_named(monkeypatch, capsys):
    monkeypatch.setitem(sim_cli.COMMANDS, "later", ("pdd.sim.not_written_yet", "a command still to come"))
    assert pdd_main(["sim", "later"]) == 2
    assert "pdd/sim/not_written_yet.py is missing" in capsys.readouterr().err


def test_pdd_help_does_not_import_torch():
    code = (
        "import sys\nfrom pdd.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr


def test_the_simulator_knows_every_built_in_preset():
    from pdd.sim.hardware.profiles import PRESET_NAMES
    from shared.model.presets import PRESETS

    assert set(PRESET_NAMES) == set(PRESETS)


def test_the_helpers_speedup_is_the_median_of_one_thread_over_helped():
    load = decode_load(1, 64)
    alone = [calibrate.Point("decode", 1, c, load, s) for c, s in ((64, 0.02), (512, 0.03), (1536, 0.06))]
    helped = [calibrate.Point("decode", 1, c, load, s) for c, s in ((64, 0.016), (512, 0.02), (1536, 0.03))]
    figures = calibrate.helper_figures(1, 10, alone, helped)
    assert (figures["threads"], figures["nice"]) == (1, 10)
    assert figures["speedup"] == pytest.approx(1.5)  # the median of 1.25, 1.5 and 2.0
    # the helped steps' own fit (a helper buys a big step more than a small one): a line here
    lines = [
        calibrate.Point("decode", 1, c, decode_load(1, c), 0.004 + 1e-5 * c) for c in (64, 512, 1536, 3072)
    ]
    step = step_cost_from_json(calibrate.helper_figures(1, 10, lines, lines)["step"])
    assert step.step_s(decode_load(1, 1000)) == pytest.approx(0.004 + 1e-5 * 1000, rel=0.01)
    assert figures["points"][2] == {
        "kind": "decode",
        "size": 1,
        "context": 1536,
        "one_thread_s": 0.06,
        "helped_s": 0.03,
    }


def test_decode_points_read_kv_of_their_own():
    """Sequences sharing one cached prefix would read the same KV blocks, from the CPU's caches."""
    timer = calibrate.Timer(calibrate._parse(["--preset", "tiny", "--quick"]), calibrate.QUICK_GRID)
    hits = timer.engine.scheduler.num_hit_tokens
    timed = timer.decode(4, 64, 3)
    assert timer.engine.scheduler.num_hit_tokens == hits  # nothing came from the prefix cache
    assert len(timed) == 3 and all(load.seqs == 4 and load.kv_read >= 4 * 65 for load, _ in timed)
    assert not timer.engine.has_unfinished()  # the sequences are dropped after the timed steps
