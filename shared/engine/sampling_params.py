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

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        if kwargs.get("stop") is not None:
            kwargs["stop"] = list(kwargs["stop"])
        else:
            kwargs.pop("stop", None)
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
