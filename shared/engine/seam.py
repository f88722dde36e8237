"""The engine seam: everything prefill, relay and main decode ask of an engine, and nothing more.

`LLMEngine` (with its BlockExchange) implements it. A service holds an `Engine` and calls it
on one thread (shared/serving/engine_loop.py); no service reaches past it into an engine's
requests, pool or KV tensors, so another engine can stand behind it.

What crosses the seam: token IDs, request ids (which also own pins and reservations), block
hashes (shared/engine/hashing.py: the chained hash every role and the router agree on),
SamplingParams, StepOutput, EngineStats, admission Verdicts, and prompt KV as it travels
between instances: a tensor [layers, 2, blocks, block_size, kv_heads, head_dim] in the
engine's `BlockFormat`. Slots (ints) are places in the engine's KV memory set aside for one
request, which a one-sided write (the RDMA path) fills before `adopt` caches them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from shared.engine.kv_admission import Verdict
from shared.engine.outputs import EngineStats, StepOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import Mode


@dataclass(frozen=True)
class BlockFormat:
    """The KV of one block as it travels between instances: export_blocks gives and
    import_blocks takes [layers, 2, blocks, block_size, kv_heads, head_dim] tensors of
    `dtype`; `shape` is that without the blocks axis."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # (layers, 2, block_size, kv_heads, head_dim)


@runtime_checkable
class Engine(Protocol):
    # ---- identity and limits ----------------------------------------------------------
    model_id: str  # names the weights; part of every block hash
    block_size: int  # tokens per KV block
    max_model_len: int  # longest sequence, prompt plus output

    def block_format(self) -> BlockFormat: ...

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        num_prompt_tokens: int | None = None,
        mode: Mode = Mode.GENERATE,
    ) -> None:
        """Queue a request over the prefix cache. Mode.PREFILL: compute the prompt, sample the
        first token and keep the blocks until abort; Mode.HOLD: compute and wait for extend;
        Mode.GENERATE: decode to the end. Tokens past num_prompt_tokens are output already."""

    def extend(self, rid: str, token_ids: list[int], *, final: bool) -> None:
        """Append token IDs to a HOLD request and compute their KV; final=True then decodes."""

    def abort(self, rid: str) -> bool:
        """Drop the request in any state, freeing its blocks; False if unknown. Pins stay."""

    def generated_token_ids(self, rid: str) -> list[int]: ...

    def computed_block_hashes(self, rid: str) -> list[int]:
        """Hashes of the request's full blocks whose KV is computed (what may be exported)."""

    def block_hashes(self, token_ids: list[int]) -> list[int]: ...

    def lifetime_blocks(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """KV blocks a request of this prompt length may hold until it finishes."""

    # ---- stepping and load ------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Work for step(); held and prefilled requests wait for the caller and do not count."""

    def step(self) -> list[StepOutput]: ...

    def stats(self) -> EngineStats: ...

    def num_requests(self) -> int:
        """Requests the engine still knows (any thread: a size for metrics)."""

    def num_pin_owners(self) -> int:
        """Owners holding pins (any thread: a size for metrics)."""

    # ---- blocks in and out, pins and reservations --------------------------------------
    def export_blocks(self, hashes: list[int]) -> torch.Tensor:
        """The KV of cached blocks, on the CPU, in block_format()."""

    def import_blocks(self, hashes: list[int], kv: torch.Tensor, *, pin: str | None = None) -> int:
        """Cache the blocks not cached yet, all or nothing (KVShortageError when full);
        returns how many were new. With pin, every block of `hashes` stays pinned for it."""

    def reserve(self, owner: str, hashes: list[int], blocks: int) -> tuple[Verdict, int]:
        """Promise `blocks` to owner for its life, pin the cached leading run of `hashes` and
        set aside room for the rest; (verdict, blocks cached). Nothing changes unless ADMIT."""

    def share(self, owner: str, landed: list[int], lost: list[int] = ()) -> list[int]:
        """Blocks owner waited for while another request's transfer brought them: pin those
        of `landed` that are cached, give back room set aside for `landed` and `lost`.
        Returns the hashes pinned."""

    def unpin(self, owner: str) -> None:
        """End the owner's pins, the room set aside for it and its reservation."""

    # ---- slots for one-sided writes (the RDMA path) -------------------------------------
    def slot_memory(self) -> torch.Tensor:
        """The memory slots index, registered whole for one-sided writes."""

    def take_spare(self, owner: str, n: int) -> list[int]:
        """Up to n slots of the room set aside for owner, the caller's to fill; each goes back
        with adopt (filled), return_spare or release_blocks."""

    def adopt(self, owner: str, h: int, slot: int) -> None:
        """A taken slot holds h's KV: cache it, pinned for owner."""

    def return_spare(self, owner: str, slot: int) -> None:
        """A taken slot, unfilled: owner's again (freed if owner is gone)."""

    def release_blocks(self, slots: list[int]) -> None:
        """Free taken slots."""

    # ---- the prefix cache as the routers follow it -------------------------------------
    def drain_block_events(self) -> list[tuple[str, int]]:
        """("stored" | "evicted", hash) since the last drain, in order."""

    def cached_hashes(self) -> list[int]:
        """Every block hash cached now (a snapshot for a follower that lost events)."""
