"""Linear layers with their weights pre-packed for oneDNN, on the CPU.

A plain `F.linear` on the CPU re-lays the weight out for its matrix kernel on every call (or
takes a generic path for skinny batches); oneDNN can do that once, at load, and then run each
step's product on the blocked layout directly. This is what PyTorch's own CPU compiler does
for frozen models (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`); the
engine does it without compiling.

The packed copy replaces the weight, so memory stays the same; a layer whose weight is shared
(the LM head tied to the embeddings) is packed into a copy and keeps the shared one for the
embedding. Results differ from `F.linear` in the last bits (another summation order), as
any other matrix kernel's would.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.panel_linear import PanelLinear, fits_panels

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-packed weight; `weight` (and the state dict) unpack it
    into nn.Linear's layout for the few readers outside the forward (exports, checks)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), False)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], ""
        )
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def can_pack(model: nn.Module) -> str | None:
    """None if the model's linear layers can be packed here, else why not."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"weights on {param.device.type}"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {param.dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    try:  # the op is internal to PyTorch: check it exists and agrees with F.linear
        w, x = torch.randn(8, 16, dtype=param.dtype), torch.randn(3, 16, dtype=param.dtype)
        got = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], ""
        )
        if not torch.allclose(got, F.linear(x, w), rtol=1e-2, atol=1e-2):
            return "oneDNN's packed linear disagrees with F.linear"
    except (RuntimeError, AttributeError) as e:
        return f"oneDNN's packed linear is unavailable ({e})"
    return None


@torch.no_grad()
def pack_linears(model: nn.Module, panel_ops: ModuleType | None = None) -> tuple[int, int]:
    """Replace every nn.Linear in `model`, in place: by a PanelLinear where `panel_ops` is
    given and the layer fits its panels, else by a PackedLinear; -> (panels, oneDNN) counts."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    panels = 0
    for parent, name, child in targets:
        if panel_ops is not None and fits_panels(child):
            setattr(parent, name, PanelLinear(child, panel_ops))
            panels += 1
        else:
            setattr(parent, name, PackedLinear(child))
    return panels, len(targets) - panels


def choose_linear_backend(model: nn.Module, asked: str) -> str:
    """Pack the model's linear layers as `asked`: "panel" (the panel kernel where a layer fits
    it, oneDNN for the rest), "packed" (oneDNN), "torch" (F.linear), or "auto" (panel for fp32
    weights, else packed, where they can run); -> the backend in use. An explicit choice that
    cannot run here is an error; "auto" falls back with a log line."""
    from shared.model.kernels import panel_linear_ops

    why_not = None if asked == "torch" else can_pack(model)
    if asked == "torch" or (asked == "auto" and why_not):
        if why_not:
            log.info("linear layers: F.linear (%s)", why_not)
        return "torch"
    if why_not:
        raise ValueError(f"linear_backend={asked} cannot run here: {why_not}")
    fp32 = next(model.parameters()).dtype == torch.float32
    ops = panel_linear_ops() if asked == "panel" or (asked == "auto" and fp32) else None
    if asked == "panel" and (ops is None or not fp32):
        raise ValueError(
            "linear_backend=panel cannot run here: " + ("not fp32" if ops else "no panel kernel")
        )
    panels, onednn = pack_linears(model, ops)
    log.info("linear layers: %d in panels, %d packed for oneDNN", panels, onednn)
    return "panel" if ops is not None else "packed"
