"""SamplingParams: how one request samples and when it stops. Plain data, msgpack-friendly."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from shared.engine.errors import InvalidRequestError
from shared.engine.logprobs import MAX_LOGPROBS


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # None: the engine picks one at add_request
    ignore_eos: bool = False
    # Top alternatives to report with each generated token's logprob (None: no logprobs).
    logprobs: int | None = None
    # The same for the prompt's tokens (echo); computed by whichever instance samples output 0.
    prompt_logprobs: int | None = None
    # History-dependent logits processing (vLLM's formulas, see logits_processors.py): every
    # instance has the whole token history, so a continued request processes as one engine would.
    presence_penalty: float = 0.0  # subtracted once from each token the output has
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (or multiplies, if negative) prompt and output tokens' logits
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop_token_ids: list[int] = field(default_factory=list)  # end the request (reason stop) when sampled
    # Constrained decoding: {"kind": json|json_object|regex|choice|grammar, "spec": ...} (grammar.py).
    structured: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before the sampler (grammar aside)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        for name, kind in (("stop", list), ("logit_bias", dict), ("stop_token_ids", list)):
            if kwargs.get(name) is not None:
                kwargs[name] = kind(kwargs[name])
            else:
                kwargs.pop(name, None)
        return cls(**kwargs)

    def validate(self) -> None:
        """Raise InvalidRequestError with a message a client can act on."""

        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise bad(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise bad(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer or null, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (
                isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS
            ):
                raise bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {n!r}")
        self._validate_processing(bad)

    def _validate_processing(self, bad) -> None:
        for name, lo, hi in (
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("repetition_penalty", 1e-6, math.inf),
            ("min_p", 0.0, 1.0),
        ):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not math.isfinite(v)
                or not lo <= v <= hi
            ):
                raise bad(f"{name} must be a number in [{lo}, {hi}], got {v!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        bias = self.logit_bias
        if not isinstance(bias, dict) or not all(
            isinstance(t, int)
            and not isinstance(t, bool)
            and t >= 0
            and isinstance(b, int | float)
            and not isinstance(b, bool)
            and math.isfinite(b)
            for t, b in bias.items()
        ):
            raise bad("logit_bias must map token ids to finite numbers")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise bad("stop_token_ids must be a list of token ids")
        if self.structured is not None and not (
            isinstance(self.structured, dict) and isinstance(self.structured.get("kind"), str)
        ):
            raise bad("structured must be a {kind, spec} object or null")
