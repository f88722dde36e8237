"""What a pdd KV connector for vLLM saves and loads, as pure functions of a prompt, the store's
contents and vLLM's block bookkeeping (no vLLM import: the connector feeds them).

The store holds pdd's 16-token blocks, named by their chained hashes, so any engine's blocks
meet there: a vLLM block of `ratio` pdd blocks is saved as its pdd blocks (a prompt's partial
last vLLM block too, as far as its full pdd blocks go), and loaded when every one of its pdd
blocks is held."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.engine.hashing import block_hashes
from shared.kv.vllm_blocks import PDD_BLOCK_SIZE, block_ratio, pdd_blocks_of, tokens_covered


@dataclass(frozen=True)
class BlockLoad:
    """vLLM blocks of one request to fill from the store, and the pdd blocks (in order, `ratio`
    per vLLM block) that make them up."""

    req_id: str
    block_ids: list[int]
    hashes: list[int]


@dataclass(frozen=True)
class BlockSave:
    """pdd blocks of one request to copy out of vLLM's cache: pdd block i lies in vLLM block
    block_ids[i], at tokens [subs[i] * 16, subs[i] * 16 + 16)."""

    req_id: str
    block_ids: list[int]
    subs: list[int]
    hashes: list[int]


def prompt_hashes(prompt: Sequence[int], model_id: str) -> list[int]:
    """The chained hash of each full pdd block of a prompt (what every pdd role names it by)."""
    return block_hashes(list(prompt), PDD_BLOCK_SIZE, model_id)


def matched_tokens(
    hashes: Sequence[int],
    held_run: Callable[[list[int]], int],
    num_prompt_tokens: int,
    vllm_block_size: int,
    local_tokens: int = 0,
) -> int:
    """Tokens of the prompt that the engine's own leading blocks (local_tokens, whole vLLM
    blocks) and the store's pdd blocks right after them cover, in whole vLLM blocks, never the
    prompt's last token (vLLM computes that one itself, for the logits of the first output)."""
    ratio = block_ratio(vllm_block_size)
    local = local_tokens // vllm_block_size * ratio
    held = local + held_run(list(hashes[local:]))
    return tokens_covered(num_prompt_tokens, held, vllm_block_size, leave_last=True)


def load_span(matched: int, num_external: int, vllm_block_size: int) -> range:
    """The request's vLLM block indices the store fills: the last num_external of its matched
    tokens (those before are vLLM's own prefix-cache hit)."""
    if matched % vllm_block_size or num_external % vllm_block_size or not 0 <= num_external <= matched:
        raise ValueError(f"{num_external} external of {matched} matched tokens is not whole blocks")
    return range((matched - num_external) // vllm_block_size, matched // vllm_block_size)


def load_hashes(hashes: Sequence[int], span: range, vllm_block_size: int) -> list[int]:
    """The pdd blocks that make up the vLLM blocks of span, in order."""
    return [hashes[i] for j in span for i in pdd_blocks_of(j, vllm_block_size)]


def pdd_blocks_to_save(
    num_hashes: int, num_prompt_tokens: int, computed_after_step: int, saved: int
) -> range:
    """Indices of the prompt's full pdd blocks whose KV is computed after this step and were
    not saved yet."""
    full = min(computed_after_step, num_prompt_tokens) // PDD_BLOCK_SIZE
    return range(saved, min(full, num_hashes))


def save_places(span: range, vllm_block_size: int) -> list[tuple[int, int]]:
    """For each pdd block index of span: (index of its vLLM block in the request, its place in it)."""
    ratio = block_ratio(vllm_block_size)
    return [divmod(i, ratio) for i in span]
