"""bench.device_blocks without a CUDA device: the CPU exactness check, a plain word, exit 0; and
its table over a result of the shape the CUDA run writes."""

from __future__ import annotations

import pytest
import torch

from bench import device_blocks


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the bench times the device")
def test_without_cuda_it_checks_the_cpu_and_exits_0(capsys):
    assert device_blocks.main([]) == 0
    out = capsys.readouterr().out
    assert "CPU exactness check (gather then scatter, 5 cases): ok" in out
    assert "no CUDA device was at hand" in out


def test_the_cpu_check_catches_a_wrong_copy(monkeypatch):
    real = torch.Tensor.index_copy_

    def off_by_one(self, dim, index, source):
        return real(self, dim, (index + 1) % self.shape[dim], source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", off_by_one)
    assert not device_blocks.exact("NHD", torch.float16, 16, 4, 2, "cpu")


def test_table_prints_each_case_with_its_ratios(capsys):
    case = {
        "layout": "NHD", "dtype": "bfloat16", "block_size": 16, "blocks": 128, "mib": 256.0,
        "gather_gbs": 20.0, "d2h_gbs": 25.0, "gather_ratio": 0.8, "scatter_gbs": 40.0,
        "h2d_gbs": 50.0, "scatter_ratio": 0.8, "gather_launch_ms": 0.4,
    }  # fmt: skip
    result = {"device": "GPU", "layers": 32, "quick": False, "exact": True, "no_stall": True}
    device_blocks.table({**result, "cases": [case]})
    out = capsys.readouterr().out
    assert "GPU: 32 layers" in out and "0.80" in out and "exact: True" in out
