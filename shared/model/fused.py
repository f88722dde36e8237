"""The decoder's small ops fused into C++ calls (shared/model/kernels/fused_ops.cpp), on the CPU.

At a few sequences per step the RMSNorms, residual adds, RoPE, SwiGLU's activation and the KV
writes are hundreds of tiny tensor ops per forward, and dispatching them costs more than the
arithmetic. The fused calls do one loop per row (or one call) instead. RoPE, SiLU x up and
the KV writes give exactly the tensor code's bits; RMSNorm sums its squares in another order,
so a norm's last bit can differ, as another matrix kernel's products would.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from shared.model.attention import Attention
from shared.model.layers import RMSNorm, SwiGLU
from shared.model.llama import SelfAttention

log = logging.getLogger(__name__)


def use_fused_ops(model: nn.Module, ops: ModuleType | None) -> int:
    """Point every RMSNorm, attention block, attention layer (its KV writes) and SwiGLU of
    `model` at `ops` (None: back to tensor ops); -> how many modules were set."""
    targets = [m for m in model.modules() if isinstance(m, (RMSNorm, SelfAttention, Attention, SwiGLU))]
    for m in targets:
        m.fused = ops
    return len(targets)


def why_not_fused(model: nn.Module) -> str | None:
    """None if the fused ops can run on this model here, else why not."""
    from shared.model.kernels import fused_ops

    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"weights on {param.device.type}"
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {param.dtype}"
    if fused_ops() is None:
        return "the C++ kernels did not load (see the log)"
    return None


def choose_fused_ops(model: nn.Module, asked: str) -> str:
    """Fuse the small ops if `asked` is "fused" (or "auto" and they can run); -> the choice in
    use. "fused" where it cannot run is an error, "auto" falls back with a log line."""
    from shared.model.kernels import fused_ops

    why_not = None if asked == "torch" else why_not_fused(model)
    if asked == "torch" or (asked == "auto" and why_not):
        if why_not:
            log.info("small ops: tensor ops (%s)", why_not)
        use_fused_ops(model, None)
        return "torch"
    if why_not:
        raise ValueError(f"small_ops=fused cannot run here: {why_not}")
    log.info(
        "small ops: %d modules fused (RMSNorm with its residual add, RoPE, SiLU x up, KV writes)",
        use_fused_ops(model, fused_ops()),
    )
    return "fused"
