"""The engine seam's block calls (shared/engine/seam.py), answered by pdd's engine through its
BlockExchange: what moves, pins and names KV blocks by hash. A base of LLMEngine, kept apart so
the engine itself reads as requests and steps."""

from __future__ import annotations

import torch

from shared.engine.block_exchange import BlockExchange
from shared.engine.kv_admission import Verdict
from shared.engine.seam import BlockFormat


class ExchangeCalls:
    exchange: BlockExchange
    kv_cache: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]

    def block_format(self) -> BlockFormat:
        layers, two, _, *block = self.kv_cache.shape
        return BlockFormat(self.kv_cache.dtype, (layers, two, *block))

    def num_pin_owners(self) -> int:
        return len(self.exchange.pins)

    def export_blocks(self, hashes: list[int]) -> torch.Tensor:
        return self.exchange.export_blocks(hashes)

    def import_blocks(self, hashes: list[int], kv: torch.Tensor, *, pin: str | None = None) -> int:
        return self.exchange.import_blocks(hashes, kv, pin=pin)

    def reserve(self, owner: str, hashes: list[int], blocks: int) -> tuple[Verdict, int]:
        return self.exchange.reserve(owner, hashes, blocks)

    def share(self, owner: str, landed: list[int], lost: list[int] = ()) -> list[int]:
        return self.exchange.share(owner, landed, lost)

    def unpin(self, owner: str) -> None:
        self.exchange.unpin(owner)

    def slot_memory(self) -> torch.Tensor:
        return self.kv_cache  # slots are block ids of the pool

    def take_spare(self, owner: str, n: int) -> list[int]:
        return self.exchange.take_spare(owner, n)

    def adopt(self, owner: str, h: int, slot: int) -> None:
        self.exchange.adopt(owner, h, slot)

    def return_spare(self, owner: str, slot: int) -> None:
        self.exchange.return_spare(owner, slot)

    def release_blocks(self, slots: list[int]) -> None:
        self.exchange.release_blocks(slots)

    def drain_block_events(self) -> list[tuple[str, int]]:
        return self.exchange.drain_events()

    def cached_hashes(self) -> list[int]:
        return self.exchange.cached_hashes()
