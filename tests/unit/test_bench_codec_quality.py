"""The codec comparison of `pdd bench bandwidth` on the tiny preset, kept small: it runs, int8
is closer to the exact path than int4, and every figure is in range."""

from __future__ import annotations

from bench.codec_quality import NOISE, measure
from shared.config import ModelSettings


def test_codec_figures_on_the_tiny_preset() -> None:
    r = measure(ModelSettings(preset="tiny"), ["int8", "int4"], prompts=1, prompt_tokens=48, new_tokens=6)
    f = r["codecs"]
    assert set(f) == {"int8", "int4", NOISE} and r["dtype"] == "float32"
    assert 3.9 < f["int8"]["bytes_ratio"] < 4 and 7.5 < f["int4"]["bytes_ratio"] < 8
    assert f[NOISE]["bytes_ratio"] == 1.0 and "encode_bytes_per_s" not in f[NOISE]
    assert 0 <= f["int8"]["mean_kl"] < f["int4"]["mean_kl"] < 0.5
    for row in f.values():
        assert 0 <= row["top1_agreement"] <= 1 and 0 <= row["greedy_agreement"] <= 1
    assert f["int8"]["top1_agreement"] == 1.0 and f["int8"]["encode_bytes_per_s"] > 1e6
