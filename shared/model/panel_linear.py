"""Linear layers over weights packed in panels of 32 output columns (fp32, CPU).

A decode step multiplies a few rows by every weight, so it is bound by reading the weights;
oneDNN's packed kernels read them at about half the memory's speed at one to two rows here.
The panel kernel (shared/model/kernels/panel_linear.cpp) streams each panel once, in order,
and runs at the weight-reading floor at one row and even with oneDNN up to a few hundred.
A long prefill chunk (LARGE_ROWS rows or more) is a compute-bound product, where the library
kernel is faster when it has threads to spread over: the panels are laid back out into a plain
weight for that one call (a copy of the weight, a few percent of such a product's time). On one
torch thread the panels are even with it, and faster where helper threads join them (1,024 rows
of the small preset: 382 ms a chunk against 523).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

PANEL = 32  # output columns per panel (the kernel's)
LARGE_ROWS = 1024  # rows from which F.linear over the plain weight is faster (2 threads here)


class PanelLinear(nn.Module):
    """nn.Linear's forward over panel-packed weights; `weight` (and the state dict) give them
    back in nn.Linear's layout for readers outside the forward (exports, checks)."""

    def __init__(self, linear: nn.Linear, ops: ModuleType) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.ops = ops
        self.panels = ops.pack_panels(linear.weight.detach())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), False)

    @property
    def weight(self) -> torch.Tensor:
        return self.panels.transpose(1, 2).reshape(self.out_features, self.in_features)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] >= LARGE_ROWS and torch.get_num_threads() > 1:
            y = F.linear(rows, self.weight, self.bias)
        else:
            y = self.ops.panel_linear(
                rows if rows.stride(-1) == 1 else rows.contiguous(), self.panels, self.bias
            )
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, in {PANEL}-column panels"


def fits_panels(linear: nn.Linear) -> bool:
    w = linear.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and linear.out_features % PANEL == 0
