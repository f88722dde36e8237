"""What the router needs to know about the served model, without loading its weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.config import ModelSettings
from shared.model.config import ModelConfig, config_from_hf
from shared.model.loader import resolve_dtype
from shared.model.presets import preset_config
from shared.model.tokenizer import load_tokenizer


@dataclass
class ModelInfo:
    config: ModelConfig
    tokenizer: object
    dtype_bytes: int

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token(self.dtype_bytes)


def describe_model(settings: ModelSettings) -> ModelInfo:
    dtype_bytes = resolve_dtype(settings.dtype).itemsize
    if settings.path:
        config = config_from_hf(Path(settings.path))
        tokenizer = load_tokenizer(Path(settings.path), config.eos_token_id, with_chat_template=True)
        return ModelInfo(config, tokenizer, dtype_bytes)
    config = preset_config(settings.preset, settings.seed)
    return ModelInfo(config, load_tokenizer(None, config.eos_token_id), dtype_bytes)
