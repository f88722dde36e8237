"""The engine seam's block calls (shared/engine/seam.py) over a MemoryStore of pdd's blocks: the
base of VllmEngine, which owns `store`, `dtype` and `_format`. Export and import go through the
store (the connector moves blocks between it and vLLM's paged cache); pins are the store's; the
RDMA path's slots are refused (it writes into pdd's engine's KV memory)."""

from __future__ import annotations

import torch

from shared.engine.errors import EngineError
from shared.engine.kv_admission import Verdict
from shared.engine.seam import BlockFormat
from shared.vllm.memory_store import MemoryStore

NO_RDMA = "the RDMA path writes into pdd's engine's KV memory; with vLLM engines KV goes over TCP"


class StoreCalls:
    store: MemoryStore
    dtype: torch.dtype
    _format: BlockFormat

    def num_pin_owners(self) -> int:
        return self.store.pin_owners

    # ---- blocks in and out, pins ------------------------------------------------------------
    def export_blocks(self, hashes: list[int]) -> torch.Tensor:
        try:
            return torch.cat([self.store.get(h) for h in hashes], dim=2)
        except KeyError as e:
            raise EngineError(f"block {e.args[0]:016x} is not cached") from None

    def import_blocks(self, hashes: list[int], kv: torch.Tensor, *, pin: str | None = None) -> int:
        if kv.dim() != 6 or kv.shape[2] != len(hashes) or tuple(kv[:, :, 0].shape) != self._format.shape:
            raise EngineError(
                f"KV {tuple(kv.shape)} does not hold {len(hashes)} blocks of {self._format.shape}"
            )
        new = self.store.put_all(hashes, [kv[:, :, i : i + 1].to(self.dtype) for i in range(len(hashes))])
        if pin is not None:
            self.store.pin(pin, hashes)
        return new

    def reserve(self, owner: str, hashes: list[int], blocks: int) -> tuple[Verdict, int]:
        if blocks > self.store.capacity:
            return Verdict.NEVER, 0
        have = self.store.held_run(hashes)
        self.store.pin(owner, hashes[:have])
        return Verdict.ADMIT, have

    def share(self, owner: str, landed: list[int], lost: list[int] = ()) -> list[int]:
        return self.store.pin(owner, landed)

    def unpin(self, owner: str) -> None:
        self.store.unpin(owner)

    # ---- the RDMA path's slots: not with vLLM -------------------------------------------------
    def slot_memory(self) -> torch.Tensor:
        raise EngineError(NO_RDMA)

    def take_spare(self, owner: str, n: int) -> list[int]:
        raise EngineError(NO_RDMA)

    def adopt(self, owner: str, h: int, slot: int) -> None:
        raise EngineError(NO_RDMA)

    def return_spare(self, owner: str, slot: int) -> None:
        raise EngineError(NO_RDMA)

    def release_blocks(self, slots: list[int]) -> None:
        raise EngineError(NO_RDMA)

    def drain_block_events(self) -> list[tuple[str, int]]:
        return self.store.drain_events()

    def cached_hashes(self) -> list[int]:
        return self.store.hashes()
