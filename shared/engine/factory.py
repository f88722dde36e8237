"""The one place a service's engine is built, by kind (EngineSettings.kind: PDD_ENGINE or PDD_ENGINE__KIND)."""

from __future__ import annotations

import sys

from shared.config import EngineSettings, ModelSettings, engine_unavailable
from shared.engine.engine import LLMEngine
from shared.engine.errors import EngineError
from shared.engine.seam import Engine
from shared.vllm.checkpoint import vllm_refuses


def require_available_engine(
    engine: EngineSettings, service: str, model: ModelSettings | None = None
) -> None:
    """Exit 2 before the service starts when this environment cannot run the engine it is
    given, or that engine cannot load the model."""
    why = engine_unavailable(engine.kind)
    if why is None and engine.kind == "vllm" and model is not None:
        why = vllm_refuses(model)
    if why is not None:
        print(f"{service}: refusing to start: {why}; set PDD_ENGINE=pdd", file=sys.stderr)
        raise SystemExit(2)


def build_engine(model: ModelSettings, engine: EngineSettings) -> Engine:
    why = engine_unavailable(engine.kind)
    if why is not None:
        raise EngineError(why)
    if engine.kind == "vllm":
        from shared.vllm.engine import VllmEngine  # vLLM is imported only where it runs

        return VllmEngine(model, engine)
    return LLMEngine(model, engine)
