"""Model shapes and hardware profiles as data, and the Chip a profile makes of a model.

Model shapes: pdd/sim/hardware/models/<name>.json (the fields of a Hugging Face config.json, with the
file they come from as "source"), plus the built-in presets "tiny" and "small", read from
shared/model/presets.py in fp32 as the real engine runs them by default.

Hardware profiles: pdd/sim/hardware/profiles/<name>.json, and $PDD_SIM_PROFILES/<name>.json (which
wins on a name clash). Two kinds:
  roofline    peak bf16 FLOP/s, HBM bandwidth, memory, efficiency factors, a per-step overhead
              and a price: the step cost of any model follows from its shape;
  calibrated  step-cost coefficients fitted by `pdd sim calibrate` to one model on one machine:
              only that model (name and dtype) may use it.
Every figure of a profile names its public source (or says it is an assumption) in "sources".
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from pdd.sim.hardware.chip import Chip
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.hardware.step_cost import Linear, StepCost

HERE = Path(__file__).parent
MODELS_DIR = HERE / "models"
BUILTIN_PROFILES = HERE / "profiles"
ENV = "PDD_SIM_PROFILES"  # a directory of the user's profiles; `pdd sim calibrate` writes there
SERVED_DEFAULT = "default"  # the model `pdd up` serves when none is named (SmolLM2-135M-Instruct)
PRESET_NAMES = ("tiny", "small", "medium")  # shared/model/presets.py (not imported here: it imports torch)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "fp8": 1}
# The figures each kind must carry, each with an entry in "sources".
FIGURES = {
    "roofline": (
        "peak_bf16_flops",
        "hbm_bandwidth_bytes_per_s",
        "memory_bytes",
        "compute_efficiency",
        "memory_efficiency",
        "usable_memory_fraction",
        "overhead_s",
        "price_per_hour",
    ),
    "calibrated": ("step", "memory_bytes", "usable_memory_fraction", "price_per_hour"),
}


# ---- model shapes ----------------------------------------------------------------------
def model_names() -> list[str]:
    return sorted([*PRESET_NAMES, SERVED_DEFAULT, *(p.stem for p in MODELS_DIR.glob("*.json"))])


def model_spec(name: str, dtype: str | None = None) -> ModelSpec:
    """The shape of a built-in preset or a model file; `dtype` overrides its default
    (fp32 for the presets, the config's torch_dtype for a model file)."""
    if name in PRESET_NAMES:
        return _preset_spec(name, dtype or "float32")
    path = MODELS_DIR / f"{name}.json"
    if name == SERVED_DEFAULT or Path(name).suffix == ".gguf" or Path(name).is_dir():
        return _served_spec(name, dtype)
    if not path.exists():
        raise ValueError(
            f"unknown model {name!r}; available: {', '.join(model_names())} or a checkpoint's path"
        )
    cfg = json.loads(path.read_text())
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    fp8 = cfg.get("quantization_config", {}).get("quant_method") == "fp8"  # weights in fp8
    # The KV cache is kept in the activations' dtype (torch_dtype) unless the engine is told
    # otherwise (serving.kv_cache_dtype, e.g. fp8).
    kv_dtype = cfg.get("serving", {}).get("kv_cache_dtype") or cfg.get("torch_dtype", "bfloat16")
    interval = cfg.get("full_attention_interval")  # hybrid attention: one layer in this many
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=cfg["hidden_size"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        dtype_bytes=_dtype_bytes(dtype or ("float8" if fp8 else cfg.get("torch_dtype", "bfloat16"))),
        kv_dtype_bytes=None if dtype else _dtype_bytes(kv_dtype),
        experts=cfg.get("num_experts", 0),
        experts_per_token=cfg.get("num_experts_per_tok", 0),
        expert_intermediate=cfg.get("moe_intermediate_size", 0),
        shared_expert_intermediate=cfg.get("shared_expert_intermediate_size", 0),
        kv_layers=layers // interval if interval else None,
        kv_token_bytes=cfg.get("serving", {}).get("kv_bytes_per_token"),
        attn_pair_flops=cfg.get("serving", {}).get("attn_flops_per_pair"),
        expert_parallel=bool(cfg.get("serving", {}).get("expert_parallel")),
        tied_embeddings=bool(cfg.get("tie_word_embeddings")),
    )


def model_file(name: str) -> dict:
    """A model file's fields as written (its sources and serving notes with them)."""
    return json.loads((MODELS_DIR / f"{name}.json").read_text())


def _preset_spec(name: str, dtype: str) -> ModelSpec:
    from shared.model.presets import PRESETS  # lazy: imports torch
    from shared.model.tokenizer import ByteTokenizer

    p = PRESETS[name]
    return ModelSpec(
        name=name,
        layers=p["num_layers"],
        hidden=p["hidden_size"],
        heads=p["num_heads"],
        kv_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],
        intermediate=p["intermediate_size"],
        vocab=ByteTokenizer.vocab_size,
        dtype_bytes=_dtype_bytes(dtype),
    )


def _served_spec(name: str, dtype: str | None) -> ModelSpec:
    """The shape of a model `pdd up --model` serves: the embedded default or a checkpoint's
    path (its config read without loading the weights)."""
    from shared.config import ModelSettings  # lazy: imports torch
    from shared.model.describe import describe_model

    settings = ModelSettings(path=None if name == SERVED_DEFAULT else name, dtype=dtype or "auto")
    info = describe_model(settings)
    c = info.config
    return ModelSpec(
        name=name,
        layers=c.num_layers,
        hidden=c.hidden_size,
        heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
        dtype_bytes=info.dtype_bytes,
        tied_embeddings=c.tie_word_embeddings,
    )


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# ---- hardware profiles -----------------------------------------------------------------
def profile_dirs() -> list[Path]:
    """Where profiles are read from, the later winning on a name clash."""
    user = os.environ.get(ENV)
    return [BUILTIN_PROFILES] + ([Path(user)] if user else [])


def profile_dir_for_writing() -> Path:
    user = os.environ.get(ENV)
    return Path(user) if user else BUILTIN_PROFILES


def _profile_paths() -> dict[str, Path]:
    return {p.stem: p for d in profile_dirs() for p in sorted(d.glob("*.json"))}


def profile_names() -> list[str]:
    return sorted(_profile_paths())


def load_profile(name: str) -> dict:
    path = _profile_paths().get(name)
    if path is None:
        raise ValueError(f"unknown hardware profile {name!r}; available: {', '.join(profile_names())}")
    profile = json.loads(path.read_text())
    if profile.get("kind") not in FIGURES:
        raise ValueError(f"{path}: kind must be one of {', '.join(FIGURES)}, not {profile.get('kind')!r}")
    return profile


def chip(profile_name: str, model: ModelSpec, tp: int = 1, ep: int = 1) -> Chip:
    """The instance `profile_name` makes of `model` on `tp` chips (tensor parallel): its step
    costs, KV room and price (tp chips' worth). `ep`: an expert-parallel model's group of chips
    (the instance holds 1/ep of the routed experts and reads only those each step)."""
    profile = load_profile(profile_name)
    weights = model.resident_weight_bytes(ep)
    if profile["kind"] == "roofline":
        step = roofline_step_cost(profile, model, tp, weights)
    else:
        if tp != 1:
            raise ValueError(
                f"profile {profile_name!r} is calibrated on one device: tensor parallel needs a roofline profile"
            )
        _check_fitted_model(profile_name, profile, model)
        step = step_cost_from_json(profile["step"])
    usable = tp * int(profile["memory_bytes"] * profile["usable_memory_fraction"])
    if usable <= weights:
        raise ValueError(
            f"{model.name} ({weights / 1e9:.1f} GB of weights) does not fit in "
            f"{tp} x {profile_name}'s usable memory ({usable / 1e9:.1f} GB)"
        )
    # Each chip keeps its share of the KV heads; with fewer KV heads than chips they repeat.
    kv = (usable - weights) * min(tp, model.kv_heads) // tp
    return Chip(profile_name, step, kv, tp * float(profile["price_per_hour"]), tp)


def helped_step(profile_name: str) -> StepCost | None:
    """A calibrated profile's steps with the kernels' helper threads on an idle host
    (`pdd sim calibrate --helper-threads`); None where it was not timed so."""
    step = load_profile(profile_name).get("helpers", {}).get("step")
    return step_cost_from_json(step) if step else None


def roofline_step_cost(profile: dict, model: ModelSpec, tp: int = 1, weights: int | None = None) -> StepCost:
    """compute: FLOPs over effective peak; memory: the weights plus every KV byte read or
    written over effective bandwidth (each step reads all weights once: a decode batch of an
    MoE model touches nearly every expert). On `tp` chips each computes and reads its 1/tp
    share (the KV: 1/min(tp, KV heads)), and every layer adds two all-reduces of the step's
    activations over the chips' interconnect (ring: 2(tp-1)/tp of them each way), not
    overlapped with compute."""
    flops = tp * profile["peak_bf16_flops"] * profile["compute_efficiency"]
    bandwidth = tp * profile["hbm_bandwidth_bytes_per_s"] * profile["memory_efficiency"]
    kv_s = model.kv_bytes_per_token / (bandwidth * min(tp, model.kv_heads) / tp)
    overhead, comm = float(profile["overhead_s"]), 0.0
    if tp > 1:
        if "interconnect_bytes_per_s" not in profile:
            raise ValueError(
                "tensor parallel needs the profile's interconnect_bytes_per_s and allreduce_latency_s"
            )
        reduces = 2 * model.layers
        activations = model.hidden * 2 * 2 * (tp - 1) / tp  # bf16, per token
        comm = reduces * activations / profile["interconnect_bytes_per_s"]
        overhead += reduces * profile["allreduce_latency_s"]
    return StepCost(
        overhead_s=overhead,
        compute=Linear(
            per_token=model.flops_per_token / flops + comm, per_attn=model.flops_per_attn_pair / flops
        ),
        memory=Linear(const=(weights or model.weight_bytes) / bandwidth, per_token=kv_s, per_kv_read=kv_s),
    )


def _check_fitted_model(profile_name: str, profile: dict, model: ModelSpec) -> None:
    fitted = profile["model"]
    if model.name != fitted["name"] or model.dtype_bytes != _dtype_bytes(fitted["dtype"]):
        raise ValueError(
            f"profile {profile_name!r} was calibrated for model {fitted['name']!r} in {fitted['dtype']}; "
            f"it cannot time {model.name!r} ({model.dtype_bytes} bytes per value): use a roofline "
            f"profile, or calibrate one for that model (`pdd sim calibrate --model NAME`)"
        )


def step_cost_from_json(d: dict) -> StepCost:
    return StepCost(float(d["overhead_s"]), Linear(**d["compute"]), Linear(**d["memory"]))


def step_cost_to_json(step: StepCost) -> dict:
    return {"overhead_s": step.overhead_s, "compute": asdict(step.compute), "memory": asdict(step.memory)}
