"""Prefill's engine-thread side: which freshly computed KV blocks go to which peer.

Everything here runs on the engine thread and is touched nowhere else; the event loop
hands it work by calling its methods through the EngineLoop, and gets `BlockExport`s back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine import Engine, Mode, SamplingParams

Blocks = tuple[list[int], torch.Tensor]  # block hashes, their KV [layers, 2, blocks, ...]


@dataclass
class ExportPlan:
    to_local: bool  # P→RLD→MD: every block also goes to the relay
    md_missing: frozenset[int] | None = None  # None until MD's target is known
    exported: int = 0  # leading computed full blocks already looked at


@dataclass(frozen=True)
class BlockExport:
    rid: str
    local: Blocks | None = None  # for the relay: every new block
    wan: Blocks | None = None  # for MD: the new blocks it lacks


class BlockExporter:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._plans: dict[str, ExportPlan] = {}

    def admit(self, rid: str, prompt_ids: list[int], params: SamplingParams, to_local: bool) -> None:
        self.engine.add_request(rid, prompt_ids, params, mode=Mode.PREFILL)
        self._plans[rid] = ExportPlan(to_local)

    def target(self, rid: str, missing: list[int]) -> BlockExport | None:
        """MD's target is known: from now on export what it lacks, and export now what it
        lacks of the blocks already computed (skipped until now when no relay needed them)."""
        plan = self._plans.get(rid)
        if plan is None:
            return None
        plan.md_missing = frozenset(missing)
        done = self.engine.computed_block_hashes(rid)[: plan.exported]
        wanted = [h for h in done if h in plan.md_missing]
        return BlockExport(rid, wan=(wanted, self.engine.export_blocks(wanted))) if wanted else None

    def after_step(self, engine: Engine) -> list[BlockExport]:
        """After each step: export the full blocks that just got computed."""
        out = []
        for rid, plan in self._plans.items():
            new = engine.computed_block_hashes(rid)[plan.exported :]
            if not new:
                continue
            plan.exported += len(new)
            export = self._split(rid, plan, new)
            if export is not None:
                out.append(export)
        return out

    def _split(self, rid: str, plan: ExportPlan, new: list[int]) -> BlockExport | None:
        md = plan.md_missing or frozenset()
        idx = [i for i, h in enumerate(new) if h in md]
        if not plan.to_local:
            wanted = [new[i] for i in idx]
            return BlockExport(rid, wan=(wanted, self.engine.export_blocks(wanted))) if wanted else None
        kv = self.engine.export_blocks(new)
        wan = None
        if idx:
            wan = ([new[i] for i in idx], kv if len(idx) == len(new) else kv[:, :, idx].contiguous())
        return BlockExport(rid, local=(new, kv), wan=wan)

    def forget(self, rid: str) -> None:
        """The request is released (kept until then: MD's target may come after prefill)."""
        self._plans.pop(rid, None)
