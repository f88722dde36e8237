"""The attention backend seam: which code attends over the paged cache.

`paged`: the C++ kernel reading K/V in place through the block tables (CPU tensors).
`reference`: gather each sequence's context, then SDPA (any device; the numerical reference).
`auto` (default): paged where it can run, else reference. Chosen by the engine setting
`attention_backend` (PDD_ENGINE__ATTENTION_BACKEND=reference|paged|auto).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from shared.model.attention.context import AttentionBackend

log = logging.getLogger(__name__)

BackendName = Literal["auto", "paged", "reference"]


def attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    from shared.model.attention.paged_cpu import PagedCpuBackend
    from shared.model.attention.reference import ReferenceBackend
    from shared.model.kernels import paged_attention_ops

    if name not in ("auto", "paged", "reference"):
        raise ValueError(f"unknown attention backend {name!r}: auto | paged | reference")
    if name == "reference":
        return ReferenceBackend()
    if torch.device(device).type != "cpu":
        if name == "paged":
            log.info("paged attention runs on the CPU only: %s uses the reference backend", device)
        return ReferenceBackend()
    ops = paged_attention_ops()  # None: it logged why
    return ReferenceBackend() if ops is None else PagedCpuBackend(ops)
