"""load_model(settings): a seeded preset, a local Hugging Face directory or a GGUF file (the
embedded default model is one)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.config import ModelSettings
from shared.model.config import ModelConfig, config_from_hf
from shared.model.gguf_checkpoint import GGUFCheckpoint
from shared.model.gguf_tokenizer import chat_template_from_gguf, tokenizer_from_gguf
from shared.model.layers import RotaryEmbedding
from shared.model.llama import LlamaForCausalLM
from shared.model.presets import init_preset_weights, preset_config
from shared.model.source import DTYPES, ModelSource, resolve_source, serving_dtype
from shared.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

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
    """An explicit dtype name (not `auto`: see source.serving_dtype)."""
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


def _safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name), file.name


@torch.no_grad()
def load_weights(
    model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor, str]], where: Path
) -> None:
    """Copy (Hugging Face name, tensor, file) into the model, splitting q/k/v and gate/up into
    their packed matrices; every parameter must be given, and nothing else."""
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for hf_name, tensor, file in tensors:
        if "rotary_emb" in hf_name:
            continue
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        m = _PACKED_RE.match(hf_name)
        if m:
            packed, shard = _PACKED[m.group(2)]
            name = f"{m.group(1)}.{packed}.{m.group(3)}"
            if name not in params:
                raise ValueError(f"unexpected tensor {hf_name!r} in {file}")
            lo, hi = _shard_ranges(config, packed)[shard]
            target = params[name][lo:hi]
            loaded.add(f"{name}#{shard}")
        else:
            if hf_name not in params:
                raise ValueError(f"unexpected tensor {hf_name!r} in {file}")
            target = params[hf_name]
            loaded.add(hf_name)
        if target.shape != tensor.shape:
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
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
        raise ValueError(f"checkpoint {where} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_hf_weights(model: LlamaForCausalLM, path: Path) -> None:
    load_weights(model, _safetensors(path), path)


def gguf_tokenizer(
    ckpt: GGUFCheckpoint, config: ModelConfig, with_chat_template: bool = False
) -> HFTokenizer:
    meta = {k: ckpt.field(k) for k in ckpt.reader.fields if k.startswith("tokenizer.")}
    template = chat_template_from_gguf(meta, str(ckpt.path)) if with_chat_template else None
    return HFTokenizer(tokenizer_from_gguf(meta, str(ckpt.path)), config.eos_token_id, template)


def load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device
) -> tuple[LlamaForCausalLM, ModelConfig, HFTokenizer]:
    ckpt = GGUFCheckpoint(path)
    config = ckpt.config()
    tokenizer = gguf_tokenizer(ckpt, config)  # first: a file without a usable tokenizer is refused at once
    if config.eos_token_id < 0:
        raise ValueError(f"{path}: no tokenizer.ggml.eos_token_id")
    model = _empty_model(config, dtype, device)
    load_weights(model, ((n, w, path.name) for n, w in ckpt.hf_tensors(config)), path)
    return model, config, tokenizer


def load_model(settings: ModelSettings) -> tuple[LlamaForCausalLM, ModelConfig, ByteTokenizer | HFTokenizer]:
    """-> (model in eval mode, its ModelConfig, its tokenizer)."""
    source: ModelSource = resolve_source(settings)
    dtype = serving_dtype(settings.dtype, settings.device, source)
    device = torch.device(settings.device)
    if source.kind == "gguf":
        return load_gguf(source.path, dtype, device)
    if source.kind == "hf":
        path = source.path
        config = config_from_hf(path)
        tokenizer = load_tokenizer(path, config.eos_token_id)
        if config.eos_token_id < 0:
            raise ValueError(f"{path}: no eos_token_id in config.json or generation_config.json")
        model = _empty_model(config, dtype, device)
        load_hf_weights(model, path)
        return model, config, tokenizer
    config = preset_config(settings.preset, settings.seed)
    cpu = _empty_model(config, torch.float32, torch.device("cpu"))
    init_preset_weights(cpu, settings.seed)  # always fp32 on CPU: identical bits on any device
    model = _empty_model(config, dtype, device)
    model.load_state_dict(cpu.state_dict())
    return model, config, load_tokenizer(None, config.eos_token_id)
