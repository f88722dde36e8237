"""Save one of our models as a Hugging Face LlamaForCausalLM directory (bench, parity tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.model.export_tokenizer import save_byte_tokenizer
from shared.model.llama import LlamaForCausalLM
from shared.model.tokenizer import ByteTokenizer


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our packed parameters split back into Hugging Face names."""
    c = model.config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if name.startswith("model.rotary"):
            continue
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if ".qkv_proj." in name:
            for part, (lo, hi) in zip(
                ("q_proj", "k_proj", "v_proj"), ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True
            ):
                out[name.replace("qkv_proj", part)] = t[lo:hi].clone()
        elif ".gate_up_proj." in name:
            out[name.replace("gate_up_proj", "gate_proj")] = t[:inter].clone()
            out[name.replace("gate_up_proj", "up_proj")] = t[inter:].clone()
        else:
            out[name] = t.clone()
    return out


def save_hf(model: LlamaForCausalLM, out_dir: str | Path, byte_tokenizer: bool = False) -> Path:
    """Write config.json + model.safetensors. Only plain Llama (no qkv bias, no qk-norm).
    byte_tokenizer: also the presets' byte tokenizer as tokenizer files (export_tokenizer), so
    other servers given the directory tokenize as pdd does."""
    c = model.config
    if c.qkv_bias or c.qk_norm or c.o_bias:
        raise ValueError("save_hf writes plain Llama checkpoints only")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "torch_dtype": str(model.lm_head.weight.dtype).removeprefix("torch."),
    }
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if byte_tokenizer:
        if c.vocab_size != ByteTokenizer.vocab_size:
            raise ValueError(
                f"the byte tokenizer has {ByteTokenizer.vocab_size} ids, the model {c.vocab_size}"
            )
        save_byte_tokenizer(out, c.max_position_embeddings)
    return out


def save_gguf_as_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """A GGUF file's model as a Hugging Face directory: its weights dequantized to float32 (the
    values the file encodes, exactly), its tokenizer as tokenizer.json and its chat template and
    special tokens in tokenizer_config.json. The same model for a server that cannot read the
    GGUF file on this device (vLLM's GGUF kernels are GPU-only)."""
    from shared.model.gguf_checkpoint import GGUFCheckpoint
    from shared.model.loader import load_gguf

    gguf_path, out = Path(gguf_path), Path(out_dir)
    model, config, tokenizer = load_gguf(gguf_path, torch.float32, torch.device("cpu"))
    save_hf(model, out)
    tokenizer.save(out / "tokenizer.json")
    ckpt = GGUFCheckpoint(gguf_path)
    tokens = ckpt.field("tokenizer.ggml.tokens")
    special = {
        f"{name}_token": tokens[i]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if (i := ckpt.field(f"tokenizer.ggml.{key}_token_id")) is not None
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(ckpt.field("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
    }
    if (template := ckpt.field("tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}, indent=2
        )
    )
    return out
