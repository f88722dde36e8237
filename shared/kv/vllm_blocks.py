"""pdd's 16-token blocks and the larger blocks of a vLLM engine, of the same prompt.

pdd names every full 16-token block of a prompt by its chained hash (shared/engine/hashing.py),
and a chained hash names the whole prefix up to the end of its block. vLLM's blocks are
`ratio` = vllm_block_size / pdd_block_size pdd blocks each (any multiple of pdd's size), so
vLLM block j is pdd blocks [j * ratio, (j + 1) * ratio), and the hash of the last of them names
vLLM block j with everything before it. A vLLM block is full only when all its pdd blocks are:
a trailing partial one has no hash (as a trailing partial pdd block has none).
"""

from __future__ import annotations

from collections.abc import Container, Sequence

PDD_BLOCK_SIZE = 16  # the engine's block size (EngineSettings.block_size); kv/ reads no settings


def block_ratio(vllm_block_size: int, pdd_block_size: int = PDD_BLOCK_SIZE) -> int:
    """pdd blocks in one vLLM block; a size that is not a multiple of pdd's is refused."""
    if pdd_block_size <= 0 or vllm_block_size <= 0 or vllm_block_size % pdd_block_size:
        raise ValueError(
            f"vLLM block size {vllm_block_size} is not a multiple of pdd's block size {pdd_block_size}"
        )
    return vllm_block_size // pdd_block_size


def pdd_blocks_of(j: int, vllm_block_size: int, pdd_block_size: int = PDD_BLOCK_SIZE) -> range:
    """Indices of the pdd blocks that make up vLLM block j of a prompt."""
    if j < 0:
        raise ValueError(f"vLLM block index {j} is negative")
    ratio = block_ratio(vllm_block_size, pdd_block_size)
    return range(j * ratio, (j + 1) * ratio)


def vllm_block_hash(
    pdd_hashes: Sequence[int], j: int, vllm_block_size: int, pdd_block_size: int = PDD_BLOCK_SIZE
) -> int | None:
    """The pdd hash that names vLLM block j (and the prefix before it): that of its last pdd
    block. None where block j is not full (pdd_hashes: the prompt's full pdd blocks, in order)."""
    last = pdd_blocks_of(j, vllm_block_size, pdd_block_size)[-1]
    return pdd_hashes[last] if last < len(pdd_hashes) else None


def vllm_block_hashes(
    pdd_hashes: Sequence[int], vllm_block_size: int, pdd_block_size: int = PDD_BLOCK_SIZE
) -> list[int]:
    """The names of every full vLLM block of a prompt, in order."""
    ratio = block_ratio(vllm_block_size, pdd_block_size)
    return list(pdd_hashes[ratio - 1 :: ratio])


def held_run(pdd_hashes: Sequence[int], held: Container[int]) -> int:
    """How many of a prompt's pdd blocks, from the first, are held: a block is of use only with
    every block before it."""
    n = 0
    while n < len(pdd_hashes) and pdd_hashes[n] in held:
        n += 1
    return n


def tokens_covered(
    num_tokens: int,
    held_pdd_blocks: int,
    vllm_block_size: int,
    pdd_block_size: int = PDD_BLOCK_SIZE,
    *,
    leave_last: bool = False,
) -> int:
    """Tokens of a prompt of num_tokens that full vLLM blocks cover, given that its first
    held_pdd_blocks pdd blocks are held. leave_last: cover at most num_tokens - 1 (vLLM computes
    a prompt's last token itself, for its logits)."""
    ratio = block_ratio(vllm_block_size, pdd_block_size)
    if num_tokens < 0 or held_pdd_blocks < 0:
        raise ValueError(f"negative count: {num_tokens} tokens, {held_pdd_blocks} pdd blocks held")
    usable = max(num_tokens - 1, 0) if leave_last else num_tokens
    full_pdd = min(held_pdd_blocks, usable // pdd_block_size)
    return full_pdd // ratio * vllm_block_size


def complete_vllm_blocks(
    pdd_hashes: Sequence[int],
    landed: Container[int],
    vllm_block_size: int,
    pdd_block_size: int = PDD_BLOCK_SIZE,
) -> list[int]:
    """Indices of the prompt's vLLM blocks whose every pdd block has landed (pdd blocks may land
    in any order; the result need not be a leading run: see leading_complete)."""
    ratio = block_ratio(vllm_block_size, pdd_block_size)
    return [
        j
        for j in range(len(pdd_hashes) // ratio)
        if all(h in landed for h in pdd_hashes[j * ratio : (j + 1) * ratio])
    ]


def leading_complete(complete: Sequence[int]) -> int:
    """How many vLLM blocks from the first are complete, given complete_vllm_blocks' answer."""
    n = 0
    while n < len(complete) and complete[n] == n:
        n += 1
    return n
