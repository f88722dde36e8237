"""What the router needs to know about the served model, without loading its weights."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import ModelSettings
from shared.model.config import ModelConfig, config_from_hf
from shared.model.presets import preset_config
from shared.model.source import resolve_source, serving_dtype
from shared.model.tokenizer import load_tokenizer


@dataclass
class ModelInfo:
    config: ModelConfig
    tokenizer: object
    dtype_bytes: int
    served_name: str  # the model id of the API: what /v1/models lists and requests name

    @property
    def model_id(self) -> str:
        """The weights' identity (KV block hashes are keyed by it)."""
        return self.config.model_id

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token(self.dtype_bytes)


def describe_model(settings: ModelSettings) -> ModelInfo:
    source = resolve_source(settings)
    dtype_bytes = serving_dtype(settings.dtype, settings.device, source).itemsize
    if source.kind == "gguf":
        from shared.model.gguf_checkpoint import GGUFCheckpoint
        from shared.model.loader import gguf_tokenizer

        ckpt = GGUFCheckpoint(source.path)
        config = ckpt.config()
        tokenizer = gguf_tokenizer(ckpt, config, with_chat_template=True)
    elif source.kind == "hf":
        config = config_from_hf(source.path)
        tokenizer = load_tokenizer(source.path, config.eos_token_id, with_chat_template=True)
    else:
        config = preset_config(settings.preset, settings.seed)
        tokenizer = load_tokenizer(None, config.eos_token_id)
    return ModelInfo(config, tokenizer, dtype_bytes, source.served_name or config.model_id)
