"""Attention over a paged KV cache, behind one backend seam (see backend.py)."""

from shared.model.attention.backend import BackendName, attention_backend
from shared.model.attention.context import AttentionBackend, AttentionContext
from shared.model.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "AttentionContext", "BackendName", "attention_backend"]
