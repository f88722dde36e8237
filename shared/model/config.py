"""ModelConfig: the handful of numbers the decoder, the KV pool and the hashing need."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_id: int = 257
    model_id: str = "unnamed"
    o_bias: bool = False  # Llama/Qwen3 `attention_bias` also puts a bias on o_proj
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (Llama 3 has several)
    bos_token_id: int | None = None
    model_type: str = "llama"
    # linear, llama3, yarn (transformers' formulas) and freq_factors (a GGUF's rope_freqs)
    rope_scaling: dict[str, Any] | None = field(default=None)
    # Attention over the last `sliding_window` tokens only. Served exactly by never holding a
    # longer sequence (the context is capped at the window: below it, windowed attention is full
    # attention); see context_limit().
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            self.eos_token_ids = (self.eos_token_id,)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer, every KV head: nothing else is stored per token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def _rope_params(cfg: dict[str, Any], where: Path) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = dict(params)
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{where}: rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}); "
            "serving it with another rope would answer wrongly"
        )
    if kind in ("default", "dynamic"):
        # Dynamic NTK equals the unscaled rope up to max_position_embeddings, which bounds the
        # context (transformers rescales only past it).
        return theta, None
    scaling = {**scaling, "rope_type": kind}
    if kind == "yarn":
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
    return theta, scaling


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window every layer uses, or None for full attention. A window on only some layers
    is the same window: the context cap makes every layer exact."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return int(window)


def _refuse_quantized(cfg: dict[str, Any], where: Path) -> None:
    q = cfg.get("quantization_config")
    if q:
        method = q.get("quant_method", "unknown") if isinstance(q, dict) else "unknown"
        raise ValueError(
            f"{where}: {method!r}-quantized checkpoints are not supported (quantization_config); "
            "serve the unquantized checkpoint or a GGUF file"
        )


def context_limit(config: ModelConfig, requested: int | None) -> int:
    """The longest sequence served: the model's context (vLLM's default max_model_len), capped at
    the sliding window; a requested length above it is refused, never served approximately."""
    limit = config.max_position_embeddings
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "yarn":
        limit = max(limit, int(scaling["original_max_position_embeddings"] * float(scaling["factor"])))
    why = "the model's context length"
    if config.sliding_window is not None and config.sliding_window < limit:
        limit, why = config.sliding_window, "the sliding window (past it, attention would need the window)"
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds {why}, {limit} tokens")
    return requested


def config_from_hf(path: str | Path) -> ModelConfig:
    """Read a Hugging Face config.json (llama / mistral / qwen2 / qwen3)."""
    path = Path(path)
    raw = (path / "config.json").read_bytes()
    cfg = json.loads(raw)
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    _refuse_quantized(cfg, path)
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    gen_cfg = path / "generation_config.json"
    if not eos_ids and gen_cfg.exists():
        g = json.loads(gen_cfg.read_text()).get("eos_token_id")
        eos_ids = tuple(g) if isinstance(g, list) else ((g,) if g is not None else ())
    theta, scaling = _rope_params(cfg, path)
    attention_bias = bool(cfg.get("attention_bias", False))
    digest = hashlib.blake2b(raw, digest_size=6).hexdigest()
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        qk_norm=model_type == "qwen3",
        o_bias=attention_bias and model_type != "qwen2",
        eos_token_id=eos_ids[0] if eos_ids else -1,
        eos_token_ids=eos_ids or (-1,),
        bos_token_id=cfg.get("bos_token_id"),
        model_type=model_type,
        rope_scaling=scaling,
        sliding_window=_sliding_window(cfg),
        model_id=f"{path.resolve().name}-{digest}",
    )
