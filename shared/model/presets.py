"""Built-in models with deterministic seeded weights, so nothing is ever downloaded.

Weights are scaled so every layer matters (projections ~ 1/sqrt(fan_in), embeddings ~ 1)
and logits are peaky (std ~ LOGIT_STD): greedy argmax then survives the fp32 rounding
differences between batched, chunked and dense computation, which many tests rely on.
"""

from __future__ import annotations

import torch

from shared.model.config import ModelConfig
from shared.model.llama import LlamaForCausalLM
from shared.model.tokenizer import ByteTokenizer

LOGIT_STD = 8.0

PRESETS: dict[str, dict] = {
    # Fast enough for unit tests: 2 layers x 2 KV heads x 16 dims x K,V x 4 B = 512 B of KV per token.
    "tiny": dict(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=192
    ),
    # Benchmarks: 8 layers x 4 KV heads x 64 dims x K,V x 4 B = 16 KiB of KV per token in fp32.
    "small": dict(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536
    ),
    # GPU benchmarks and calibration (~1B parameters): large enough that a step's compute and
    # memory traffic show past its fixed cost. 16 x 8 x 128 x K,V x 2 B = 64 KiB of KV per token in bf16.
    "medium": dict(
        hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=8192
    ),
}


def preset_config(name: str, seed: int) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return ModelConfig(
        vocab_size=ByteTokenizer.vocab_size,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        eos_token_id=ByteTokenizer.eos_token_id,
        bos_token_id=ByteTokenizer.bos_token_id,
        model_id=f"{name}-s{seed}",
        **PRESETS[name],
    )


@torch.no_grad()
def init_preset_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Fill every parameter from one CPU generator, in a fixed order: same bits everywhere."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            w = torch.ones(p.shape)
        elif "embed_tokens" in name:
            w = torch.randn(p.shape, generator=gen)
        elif "lm_head" in name:
            w = torch.randn(p.shape, generator=gen) * (LOGIT_STD / hidden**0.5)
        else:
            w = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
        p.copy_(w.to(p.dtype))
