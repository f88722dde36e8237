"""Logprobs as OpenAI clients read them: the legacy completions object
`{tokens, token_logprobs, top_logprobs, text_offset}` or the chat one `{content: [...]}`."""

from __future__ import annotations

from shared.engine.logprobs import TokenLogprobs

FLOOR = -9999.0  # JSON has no -inf; vLLM reports it as this


def _num(logprob: float) -> float:
    return max(logprob, FLOOR)


class LogprobsFormatter:
    """Formats the logprobs of consecutive tokens of one choice; the completions format's
    text_offset runs on across calls (stream chunks continue where the last one ended)."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # characters of the choice's text before the next token

    def __call__(self, token_ids: list[int], lps: list[TokenLogprobs | None]) -> dict:
        texts = [self._text(t) for t in token_ids]
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(texts, lps, strict=True)]}
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [None if lp is None else _num(lp.logprob) for lp in lps],
            "top_logprobs": [
                None if lp is None else self._top_map(t, lp) for t, lp in zip(texts, lps, strict=True)
            ],
            "text_offset": offsets,
        }

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _top_map(self, text: str, lp: TokenLogprobs) -> dict[str, float]:
        """Best first; the chosen token is always in it (as vLLM gives it). Tokens that decode
        to the same text keep the best logprob."""
        top: dict[str, float] = {}
        for token_id, logprob in zip(lp.top_ids, lp.top_logprobs, strict=True):
            top.setdefault(self._text(token_id), _num(logprob))
        top.setdefault(text, _num(lp.logprob))
        return top

    def _chat_entry(self, text: str, lp: TokenLogprobs | None) -> dict:
        top = (
            []
            if lp is None
            else [
                {"token": (t := self._text(i)), "logprob": _num(v), "bytes": list(t.encode())}
                for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ]
        )
        logprob = None if lp is None else _num(lp.logprob)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": top}


def prompt_entries(
    num_prompt_tokens: int, prompt_logprobs: list[TokenLogprobs] | None
) -> list[TokenLogprobs | None]:
    """One per prompt token: the first has none (nothing comes before it)."""
    known: list[TokenLogprobs | None] = [None, *(prompt_logprobs or [])][:num_prompt_tokens]
    return known + [None] * (num_prompt_tokens - len(known))


def vllm_prompt_logprobs(tokenizer, prompt_ids: list[int], entries: list[TokenLogprobs | None]) -> list:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and its top alternatives."""
    out: list = []
    for token, lp in zip(prompt_ids, entries, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(i): {"logprob": _num(v), "rank": n + 1, "decoded_token": tokenizer.decode([i])}
            for n, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True))
        }
        entry.setdefault(
            str(token),
            {"logprob": _num(lp.logprob), "rank": lp.rank, "decoded_token": tokenizer.decode([token])},
        )
        out.append(entry)
    return out
