"""pdd's SamplingParams as vLLM's (0.32): a request means the same on pdd's engine and on vLLM.

vllm_sampling_kwargs is pure (no vLLM import): the keyword arguments of `vllm.SamplingParams`,
with the structured-output constraint as a plain dict under STRUCTURED_KEY.
to_vllm_sampling_params builds vLLM's objects from them. What vLLM cannot express is refused
with InvalidRequestError. Fields whose meaning is the same on both engines map as they are:
top_p, stop (the stop string left out of the text on both), ignore_eos, logprobs and
prompt_logprobs (both from the raw logits; vLLM's default max_logprobs, 20, is pdd's
MAX_LOGPROBS), the penalties (vLLM's formulas, which pdd uses), min_p (after temperature on
both), min_tokens (no EOS, stop token or stop string before it), logit_bias (the engine-level
SamplingParams does not clamp; the routers of both clamp to +-100 before), stop_token_ids.

What differs:
- seed: each engine draws from its own generator (pdd: a hash of seed and position; vLLM: a
  torch generator per request), so a seed is reproducible on one engine, not across the two.
  pdd uses the seed modulo 2**64, so it is passed as such (vLLM would take -1 as "no seed").
- structured outputs with disable_any_whitespace: JSON with no whitespace but after the
  separators on pdd (`{"a": 1, "b": 2}`), with none at all on vLLM (`{"a":1,"b":2}`); the same
  values, other tokens.
- a continued request: vLLM looks for stop strings in its own output text only, so one that
  begins in the tokens generated elsewhere and ends in vLLM's does not stop it (pdd's would).
- the output kind (cumulative or delta) is the engine's business, not the request's: not set here.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from shared.engine.errors import InvalidRequestError
from shared.engine.sampling_params import SamplingParams

STRUCTURED_KEY = "structured_outputs"  # the kwarg that to_vllm_sampling_params turns into vLLM's object
GREEDY_BELOW = 1e-5  # both engines sample greedily under this temperature
# vLLM raises a temperature in (0, 0.01) to 0.01 (numerical safety) and refuses one above 2;
# pdd samples at any temperature it is given, so those would draw from other distributions.
VLLM_MIN_TEMPERATURE = 1e-2
VLLM_MAX_TEMPERATURE = 2.0
SEED_MODULUS = 2**64
# pdd's structured dict: the kind, its spec and the one option vLLM shares (grammar.py).
STRUCTURED_FIELDS = {"kind", "spec", "disable_any_whitespace"}
JSON_OBJECT_OR_ARRAY = '{"type": ["object", "array"]}'  # the language of pdd's json_object (a schema)


def vllm_sampling_kwargs(params: SamplingParams, *, generated: int = 0) -> dict[str, Any]:
    """Keyword arguments of vllm.SamplingParams meaning what `params` means to pdd's engine.

    generated: output tokens the request already has from elsewhere (continued after a
    handoff), which vLLM is given as the end of its prompt. They count toward max_tokens and
    min_tokens as pdd's engine counts them; the prompt's logprobs went with the first tokens."""
    if isinstance(generated, bool) or not isinstance(generated, int) or generated < 0:
        raise ValueError(f"generated must be an integer >= 0, got {generated!r}")
    params.validate()
    if generated:
        _check_continuable(params)
    return {
        "temperature": _temperature(params.temperature),
        "top_p": float(params.top_p),
        "top_k": 0 if params.top_k == -1 else params.top_k,  # both: 0 (or -1) is off; vLLM prefers 0
        "min_p": float(params.min_p),
        "max_tokens": max(1, params.max_tokens - generated),
        "min_tokens": max(0, params.min_tokens - generated),
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "seed": None if params.seed is None else params.seed % SEED_MODULUS,
        "logprobs": params.logprobs,
        "prompt_logprobs": None if generated else params.prompt_logprobs,
        "presence_penalty": float(params.presence_penalty),
        "frequency_penalty": float(params.frequency_penalty),
        "repetition_penalty": float(params.repetition_penalty),
        "logit_bias": {int(t): float(b) for t, b in params.logit_bias.items()} or None,
        STRUCTURED_KEY: None if params.structured is None else structured_outputs(params.structured),
    }


def _check_continuable(params: SamplingParams) -> None:
    """vLLM counts presence and frequency over its output tokens and starts a grammar at its
    first output token: the tokens generated elsewhere, in its prompt, would not count. (pdd's
    engine counts the whole output wherever it was generated.)"""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name) != 0:
            raise InvalidRequestError(f"{name} cannot run on vLLM for a request continued from elsewhere")
    if params.structured is not None:
        raise InvalidRequestError(
            "a structured output constraint cannot run on vLLM for a request continued from elsewhere"
        )


def _temperature(t: float) -> float:
    if t < GREEDY_BELOW:
        return 0.0
    if t < VLLM_MIN_TEMPERATURE or t > VLLM_MAX_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature {t} cannot run on vLLM: it samples greedily below {GREEDY_BELOW}, "
            f"otherwise at a temperature in [{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}]"
        )
    return float(t)


def structured_outputs(structured: dict[str, Any]) -> dict[str, Any]:
    """pdd's {kind, spec, disable_any_whitespace?} as vLLM's StructuredOutputsParams fields.

    The constraint means the same to both: vLLM's default backend is xgrammar, as pdd's, and a
    choice is one of the strings exactly. (vLLM may fall back to another backend for a JSON
    schema xgrammar cannot compile; pdd refuses such a schema.)"""
    kind, spec = structured.get("kind"), structured.get("spec")
    unknown = set(structured) - STRUCTURED_FIELDS
    if unknown:
        raise InvalidRequestError(f"structured output option(s) {sorted(unknown)} cannot run on vLLM")
    out: dict[str, Any]
    if kind == "json":
        if isinstance(spec, bool):  # a schema may be `true` or `false`; vLLM takes text or an object
            spec = json.dumps(spec)
        if not isinstance(spec, str | dict):
            raise InvalidRequestError("a json constraint must be a JSON schema (an object or its text)")
        out = {"json": copy.deepcopy(spec)}
    elif kind == "json_object":
        # pdd's is xgrammar's built-in JSON grammar: an object or an array, any whitespace
        # (disable_any_whitespace has no effect); vLLM's json_object is an object only.
        return {"json": JSON_OBJECT_OR_ARRAY}
    elif kind in ("regex", "grammar"):
        if not isinstance(spec, str) or not spec:
            raise InvalidRequestError(f"a {kind} constraint must be a non-empty string")
        out = {kind: spec}
    elif kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidRequestError("a choice constraint must be a list of non-empty strings")
        out = {"choice": list(spec)}
    else:
        raise InvalidRequestError(
            f"structured output kind must be one of json, json_object, regex, choice, grammar, got {kind!r}"
        )
    if structured.get("disable_any_whitespace"):
        out["disable_any_whitespace"] = True
    return out


def to_vllm_sampling_params(params: SamplingParams, *, generated: int = 0):
    """vllm.SamplingParams for `params` (vLLM imported here: only where it is installed)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = vllm_sampling_kwargs(params, generated=generated)
    structured = kwargs.pop(STRUCTURED_KEY)
    if structured is not None:
        kwargs[STRUCTURED_KEY] = StructuredOutputsParams(**structured)
    return VllmSamplingParams(**kwargs)
