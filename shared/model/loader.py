"""load_model(settings): a built-in preset or a local Hugging Face directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.config import ModelSettings
from shared.model.config import ModelConfig, config_from_hf
from shared.model.layers import RotaryEmbedding
from shared.model.llama import LlamaForCausalLM
from shared.model.presets import init_preset_weights, preset_config
from shared.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# HF name -> (our packed name, shard index): q,k,v into qkv_proj; gate,up into gate_up_proj.
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PACKED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build on the meta device, then allocate every tensor once, in the final dtype and device."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=dtype, device=device), False
                )
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    model.model.rotary = RotaryEmbedding(config).to(device)  # inv_freq is computed, kept in fp32
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _shard_ranges(config: ModelConfig, packed: str) -> list[tuple[int, int]]:
    q, kv, i = (
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
    )
    if packed == "qkv_proj":
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    return [(0, i), (i, 2 * i)]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, path: Path) -> None:
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                if "rotary_emb" in hf_name:
                    continue
                if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                tensor = f.get_tensor(hf_name)
                m = _PACKED_RE.match(hf_name)
                if m:
                    packed, shard = _PACKED[m.group(2)]
                    name = f"{m.group(1)}.{packed}.{m.group(3)}"
                    lo, hi = _shard_ranges(config, packed)[shard]
                    target = params[name][lo:hi]
                    loaded.add(f"{name}#{shard}")
                else:
                    if hf_name not in params:
                        raise ValueError(f"unexpected tensor {hf_name!r} in {file.name}")
                    target = params[hf_name]
                    loaded.add(hf_name)
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}"
                    )
                target.copy_(tensor.to(target.dtype))
    missing = []
    for name in params:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        packed = name.split(".")[-2]
        if packed in ("qkv_proj", "gate_up_proj"):
            n = len(_shard_ranges(config, packed))
            missing += [f"{name}#{s}" for s in range(n) if f"{name}#{s}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_model(settings: ModelSettings) -> tuple[LlamaForCausalLM, ModelConfig, ByteTokenizer | HFTokenizer]:
    """-> (model in eval mode, its ModelConfig, its tokenizer)."""
    dtype = resolve_dtype(settings.dtype)
    device = torch.device(settings.device)
    if settings.path:
        path = Path(settings.path)
        config = config_from_hf(path)
        model = _empty_model(config, dtype, device)
        load_hf_weights(model, path)
        tokenizer = load_tokenizer(path, config.eos_token_id)
        if isinstance(tokenizer, HFTokenizer) and config.eos_token_id < 0:
            raise ValueError(f"{path}: no eos_token_id in config.json or generation_config.json")
    else:
        config = preset_config(settings.preset, settings.seed)
        cpu = _empty_model(config, torch.float32, torch.device("cpu"))
        init_preset_weights(cpu, settings.seed)  # always fp32 on CPU: identical bits on any device
        model = _empty_model(config, dtype, device)
        model.load_state_dict(cpu.state_dict())
        tokenizer = load_tokenizer(None, config.eos_token_id)
    return model, config, tokenizer
