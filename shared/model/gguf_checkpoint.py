"""A GGUF file as a checkpoint: its metadata as a ModelConfig, its tensors under Hugging Face
names, dequantized by ggml's own code (the `gguf` package) into float32.

Families: the GGUF architectures `llama` (Llama and Mistral files), `qwen2` and `qwen3`.
llama.cpp writes a llama-architecture file's q and k projections with the rows of each head
interleaved (its RoPE pairs dimensions i and i+1, Hugging Face's i and i + head_dim/2); they
are put back here, so the decoder is the same one that runs safetensors checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from shared.model.config import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Weight types read: every one gguf dequantizes and llama.cpp writes for these families.
WEIGHT_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ValueError):
    """A GGUF file this server cannot serve exactly; the message says what is unsupported."""


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for one that is not a weight (rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rows in q / k (weight or bias)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One open GGUF file (memory-mapped: tensors are read when asked for)."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # the reader is only needed for GGUF files

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file: {e}") from None
        self.arch = str(self.field("general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def digest(self) -> str:
        """Identity of the file's bytes (the KV cache's model id is built from it)."""
        data = self.reader.data  # the memory map of the whole file
        return xxhash.xxh3_64_hexdigest(memoryview(data))[:12]

    def config(self) -> ModelConfig:
        a = self.arch_field
        heads = int(a("attention.head_count"))
        kv_heads = a("attention.head_count_kv") or heads
        if isinstance(kv_heads, list) or isinstance(heads, list):
            raise GGUFError(f"{self.path}: a per-layer head count is not supported")
        hidden = int(a("embedding_length"))
        head_dim = int(a("attention.key_length") or hidden // heads)
        if int(a("attention.value_length") or head_dim) != head_dim:
            raise GGUFError(f"{self.path}: key and value head sizes differ")
        if int(a("rope.dimension_count") or head_dim) != head_dim:
            raise GGUFError(f"{self.path}: partial rotary embeddings are not supported")
        if a("expert_count"):
            raise GGUFError(f"{self.path}: mixture-of-experts models are not supported")
        names = {t.name for t in self.reader.tensors}
        tokens = self.field("tokenizer.ggml.tokens") or []
        eos = self.field("tokenizer.ggml.eos_token_id")
        stops = [eos] + [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        eos_ids = tuple(dict.fromkeys(int(i) for i in stops if i is not None))
        bos = self.field("tokenizer.ggml.bos_token_id")
        embed = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        return ModelConfig(
            vocab_size=int(a("vocab_size") or len(tokens) or int(embed.shape[1])),
            hidden_size=hidden,
            num_layers=int(a("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            intermediate_size=int(a("feed_forward_length")),
            rope_theta=float(a("rope.freq_base", 10000.0)),
            rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(a("context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            o_bias="blk.0.attn_output.bias" in names,
            eos_token_id=eos_ids[0] if eos_ids else -1,
            eos_token_ids=eos_ids or (-1,),
            bos_token_id=None if bos is None else int(bos),
            model_type=self.arch,
            rope_scaling=self._rope_scaling(),
            sliding_window=a("attention.sliding_window"),
            model_id=f"{self.path.stem}-{self.digest()}",
        )

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self.arch_field("rope.scaling.type")
        factor = self.arch_field("rope.scaling.factor")
        if "rope_freqs.weight" in {t.name for t in self.reader.tensors}:
            factors = self.tensor("rope_freqs.weight")
            return {"rope_type": "freq_factors", "factors": factors.tolist()}
        if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            original = self.arch_field("rope.scaling.original_context_length")
            out = {"rope_type": "yarn", "factor": float(factor)}
            if original:
                out["original_max_position_embeddings"] = int(original)
            return out
        raise GGUFError(f"{self.path}: rope scaling {kind!r} is not supported")

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, in Hugging Face's [out, in] orientation."""
        from gguf import GGMLQuantizationType, dequantize

        t = next(t for t in self.reader.tensors if t.name == name)
        kind = GGMLQuantizationType(t.tensor_type)
        if kind.name not in WEIGHT_TYPES:
            raise GGUFError(
                f"{self.path}: tensor {name} has type {kind.name}; supported: {', '.join(WEIGHT_TYPES)}"
            )
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest-moving dimension first
        values = np.asarray(dequantize(t.data, kind), dtype=np.float32).reshape(shape)
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    def hf_tensors(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every weight; an unknown tensor is an error."""
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                continue  # read into the config's rope scaling
            name = hf_name(t.name)
            if name is None:
                raise GGUFError(f"{self.path}: unexpected tensor {t.name!r}")
            w = self.tensor(t.name)
            if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_rope_rows(w, config.num_heads)
            elif self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_rope_rows(w, config.num_kv_heads)
            yield name, w
