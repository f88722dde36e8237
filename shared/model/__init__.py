"""Llama-family decoder, weight loading and tokenizers."""

from shared.model.config import ModelConfig, config_from_hf
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_model, resolve_dtype
from shared.model.presets import PRESETS
from shared.model.tokenizer import ByteTokenizer, HFTokenizer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "HFTokenizer",
    "LlamaForCausalLM",
    "ModelConfig",
    "config_from_hf",
    "load_model",
    "resolve_dtype",
]
