"""Constrained decoding with xgrammar (vLLM's default backend): JSON schemas, any JSON object,
regular expressions, a choice of strings, EBNF grammars.

A request's constraint travels in SamplingParams.structured as plain data ({"kind", "spec"});
each engine compiles it once per distinct spec (cached) for its own tokenizer. A sequence's
matcher state is not sent anywhere: it is rebuilt from the output token IDs the sequence has,
so an instance continuing a request (a handoff, a move) masks its logits as the single engine
would. xgrammar is imported on the first constrained request only.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from functools import lru_cache
from typing import Any

import torch

from shared.engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPILED_CACHE = 256  # distinct specs an engine keeps compiled


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_spec(structured: dict[str, Any]) -> None:
    """Raise InvalidRequestError unless the spec compiles (without a tokenizer: cheap)."""
    import xgrammar as xgr

    kind, spec = structured.get("kind"), structured.get("spec")
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(_schema_text(spec), any_whitespace=_any_ws(structured))
        elif kind == "regex":
            xgr.Grammar.from_regex(_text(spec, kind))
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(_choices(spec)))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(_text(spec, kind))
        elif kind != "json_object":
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(KINDS)}, got {kind!r}"
            )
    except InvalidRequestError:
        raise
    except Exception as e:  # xgrammar's parse errors (RuntimeError, ValueError, its own types)
        raise InvalidRequestError(f"invalid {kind} constraint: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _text(spec: Any, kind: str) -> str:
    if not isinstance(spec, str) or not spec:
        raise InvalidRequestError(f"a {kind} constraint must be a non-empty string")
    return spec


def _choices(spec: Any) -> list[str]:
    if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
        raise InvalidRequestError("a choice constraint must be a list of non-empty strings")
    return spec


def _schema_text(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict | bool):
        return json.dumps(spec)
    raise InvalidRequestError("a json constraint must be a JSON schema (an object or its text)")


def _any_ws(structured: dict[str, Any]) -> bool:
    return not structured.get("disable_any_whitespace", False)


def _vocabulary(tokenizer, vocab_size: int) -> tuple[list[bytes] | list[str], str, bool]:
    """(encoded vocabulary by id, xgrammar vocab type name, add_prefix_space) for a tokenizer."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:  # the byte tokenizer: ids 0-255 are bytes, the rest special (empty)
        vocab: list[bytes] = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        return vocab, "RAW", False
    import xgrammar as xgr

    encoded = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return encoded, meta["vocab_type"].name, bool(meta["add_prefix_space"])


class Grammars:
    """One engine's compiler: specs -> matchers, for its tokenizer and vocabulary size."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._compiler = None
        self._compiled = lru_cache(maxsize=COMPILED_CACHE)(self._compile)

    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            vocab, vocab_type, prefix_space = _vocabulary(self.tokenizer, self.vocab_size)
            info = xgr.TokenizerInfo(
                vocab,
                xgr.VocabType[vocab_type],
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
                add_prefix_space=prefix_space,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, key: str):
        structured = json.loads(key)
        kind, spec, c = structured["kind"], structured.get("spec"), self.compiler()
        if kind == "json":
            return c.compile_json_schema(_schema_text(spec), any_whitespace=_any_ws(structured))
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(_text(spec, kind))
        if kind == "choice":
            return c.compile_grammar(choice_grammar(_choices(spec)))
        return c.compile_grammar(_text(spec, kind))

    def matcher(self, structured: dict[str, Any]) -> GrammarState:
        import xgrammar as xgr

        check_spec(structured)
        compiled = self._compiled(json.dumps(structured, sort_keys=True))
        return GrammarState(xgr.GrammarMatcher(compiled))


class GrammarState:
    """A sequence's matcher and how many of its output tokens it has taken."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.accepted = 0

    def catch_up(self, output: list[int]) -> None:
        """Take the output tokens not taken yet (after a handoff: all the ones it came with)."""
        for token in output[self.accepted :]:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(token):
                raise InvalidRequestError(f"output token {token} does not fit the request's grammar")
            self.accepted += 1
        self.accepted = len(output)


def apply_grammars(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Mask, in place, the tokens each row's grammar does not allow next (rows whose grammar
    has ended stay as they are)."""
    import xgrammar as xgr

    live = [(r, s) for r, s in zip(rows, states, strict=True) if not s.matcher.is_terminated()]
    if not live:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for r, s in live:
        s.matcher.fill_next_token_bitmask(bitmask, r)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[r for r, _ in live])
