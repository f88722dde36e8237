"""What a pdd KV connector for vLLM saves and loads, as pure functions of a prompt, the store's
contents and vLLM's block bookkeeping (no vLLM import: the connector feeds them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.engine.hashing import block_hashes
from shared.kv.vllm_blocks import PDD_BLOCK_SIZE, block_ratio, tokens_covered, vllm_block_hashes


@dataclass(frozen=True)
class BlockTransfer:
    """vLLM blocks of one request to copy to or from the store, and their pdd names."""

    req_id: str
    block_ids: list[int]
    hashes: list[int]


def prompt_block_names(prompt: Sequence[int], vllm_block_size: int, model_id: str) -> list[int]:
    """The pdd hash naming each full vLLM block of a prompt (that of its last 16-token block)."""
    block_ratio(vllm_block_size)  # refuses a size pdd's blocks do not divide
    return vllm_block_hashes(block_hashes(prompt, PDD_BLOCK_SIZE, model_id), vllm_block_size)


def matched_tokens(
    names: Sequence[int],
    held_run: Callable[[list[int]], int],
    num_prompt_tokens: int,
    vllm_block_size: int,
    local_tokens: int = 0,
) -> int:
    """Tokens of the prompt that the engine's own leading blocks (local_tokens, whole blocks) and
    the store's blocks right after them cover, never the prompt's last token (vLLM computes that
    one itself, for the logits of the first output token)."""
    local = local_tokens // vllm_block_size
    held = local + held_run(list(names[local:]))
    return tokens_covered(
        num_prompt_tokens, held * block_ratio(vllm_block_size), vllm_block_size, leave_last=True
    )


def load_span(matched: int, num_external: int, vllm_block_size: int) -> range:
    """The request's block indices the store fills: the last num_external of its matched
    tokens (those before are vLLM's own prefix-cache hit)."""
    if matched % vllm_block_size or num_external % vllm_block_size or not 0 <= num_external <= matched:
        raise ValueError(f"{num_external} external of {matched} matched tokens is not whole blocks")
    return range((matched - num_external) // vllm_block_size, matched // vllm_block_size)


def blocks_to_save(
    num_names: int, num_prompt_tokens: int, computed_after_step: int, saved: int, vllm_block_size: int
) -> range:
    """Indices of the prompt's full blocks whose KV this step completes and were not saved yet."""
    full = min(computed_after_step, num_prompt_tokens) // vllm_block_size
    return range(saved, min(full, num_names))
