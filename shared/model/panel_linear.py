"""Linear layers over weights packed in panels of 32 output columns (fp32, CPU).

A decode step multiplies a few rows by every weight, so it is bound by reading the weights;
oneDNN's packed kernels read them at about half the memory's speed at one to two rows here.
The panel kernel (shared/model/kernels/panel_linear.cpp) streams each panel once, in order,
and runs at the weight-reading floor at one row and even with oneDNN up to a few hundred.
A long prefill chunk (LARGE_ROWS rows or more) is a compute-bound product, where the library
kernel is faster when it has threads to spread over: the panels are laid back out into a plain
weight for that one call (a copy of the weight, a few percent of such a product's time). On one
torch thread the panels are even with it, and faster where helper threads join them (1,024 rows
of the small preset: 382 ms a chunk against 523). A layer whose width is not a multiple of 32
(an LM head over a 258-token vocabulary) is padded with zero columns, cut off again after the
product: a few percent more weight read, against a oneDNN call that waits on its thread team.
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
        pad = -self.out_features % PANEL
        self.panels = ops.pack_panels(F.pad(linear.weight.detach(), (0, 0, 0, pad)))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), False)
        # The kernel's bias is as wide as the panels.
        self.kernel_bias = None if self.bias is None else F.pad(self.bias.detach(), (0, pad))
        self.padded = pad > 0

    @property
    def weight(self) -> torch.Tensor:
        width = self.panels.shape[0] * PANEL
        return self.panels.transpose(1, 2).reshape(width, self.in_features)[: self.out_features]

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.shape[0] >= LARGE_ROWS and torch.get_num_threads() > 1:
            y = F.linear(rows, self.weight, self.bias)
        else:
            y = self.ops.panel_linear(
                rows if rows.stride(-1) == 1 else rows.contiguous(), self.panels, self.kernel_bias
            )
            if self.padded:
                y = y[:, : self.out_features].contiguous()
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, in {PANEL}-column panels"


def fits_panels(linear: nn.Linear) -> bool:
    w = linear.weight
    return w.device.type == "cpu" and w.dtype == torch.float32
