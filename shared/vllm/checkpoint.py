"""The checkpoint directory a vLLM engine loads for pdd's model settings: a Hugging Face
directory as given, or a preset's seeded weights written once as one (with the presets' byte
tokenizer), so both engines serve the same weights and token ids."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from shared.config import ModelSettings
from shared.engine.errors import EngineError
from shared.model.describe import ModelInfo
from shared.model.source import resolve_source

CHECKPOINTS = Path(os.environ.get("PDD_CHECKPOINT_DIR", Path.home() / ".cache" / "pdd" / "checkpoints"))


def vllm_refuses(model: ModelSettings) -> str | None:
    """Why vLLM's engine cannot load this model (it takes a checkpoint directory or a preset)."""
    if model.path is None and model.preset is None:
        gguf = "the default model"
    elif model.path is not None and Path(model.path).suffix == ".gguf":
        gguf = model.path
    else:
        return None
    return f"{gguf}: vLLM engines load Hugging Face checkpoint directories or presets, not a GGUF file"


def vllm_checkpoint(model: ModelSettings, info: ModelInfo) -> Path:
    source = resolve_source(model)
    if source.kind == "hf":
        return Path(source.path)
    if source.kind == "gguf":
        raise EngineError(vllm_refuses(model))
    return _preset_checkpoint(model, info)


def _preset_checkpoint(model: ModelSettings, info: ModelInfo) -> Path:
    from shared.model.export_hf import save_hf
    from shared.model.llama import LlamaForCausalLM
    from shared.model.presets import init_preset_weights

    out = CHECKPOINTS / info.model_id
    if (out / "config.json").exists():
        return out
    CHECKPOINTS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CHECKPOINTS, prefix=f".{info.model_id}-"))
    try:
        weights = LlamaForCausalLM(info.config)
        init_preset_weights(weights, model.seed)
        save_hf(weights, tmp, byte_tokenizer=True)
        try:
            tmp.rename(out)  # several engines of one host may write it at once: the first wins
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
