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

import torch
import torch.nn.functional as F
from torch import nn

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
def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear, in place; -> how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


def choose_linear_backend(model: nn.Module, asked: str) -> str:
    """Pack the model's linear layers if `asked` is "packed" (or "auto" and they can be); -> the
    backend in use. "packed" where it cannot run is an error, "auto" falls back with a log line."""
    why_not = None if asked == "torch" else can_pack(model)
    if asked == "torch" or (asked == "auto" and why_not):
        if why_not:
            log.info("linear layers: F.linear (%s)", why_not)
        return "torch"
    if why_not:
        raise ValueError(f"linear_backend=packed cannot run here: {why_not}")
    log.info("linear layers: %d packed for oneDNN", pack_linears(model))
    return "packed"
