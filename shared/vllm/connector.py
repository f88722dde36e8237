"""PddConnector: a vLLM v1 KV connector (KVConnectorBase_V1) that moves a prompt's KV as pdd's
16-token block groups named by pdd's chained hashes.

    kv_producer  saves every full pdd block of each prompt once its KV is computed
    kv_consumer  finds the leading vLLM blocks of a new prompt whose pdd blocks the store holds
                 and loads them into the blocks vLLM allocated, so vLLM computes only the rest
    kv_both      both (what pdd's roles run: shared/vllm/engine.py)

Named in vLLM's KVTransferConfig as
    kv_connector="PddConnector", kv_connector_module_path="shared.vllm.connector",
    kv_role=..., kv_connector_extra_config={"pdd_store": NAME or "pdd_store_dir": DIR,
                                            "pdd_model_id": ID}
pdd_store names a MemoryStore of this process (the engine's: the bulk channel fills and drains
it), pdd_store_dir a directory shared by engines of separate processes. pdd_model_id enters
every hash, so producer and consumer must agree (by default the model path).

Scheduler side (vLLM's engine core): get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, request_finished. Worker side: register_kv_caches, start_load_kv,
wait_for_layer_load, save_kv_layer, wait_for_save. Loads and saves are synchronous: a load is
done when start_load_kv returns, a step's saves when wait_for_save does, so no request's blocks
outlive its finish and get_finished has nothing to report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from shared.kv.device_blocks import DeviceBlocks
from shared.kv.vllm_blocks import PDD_BLOCK_SIZE
from shared.vllm.block_store import BlockStore
from shared.vllm.cache_layout import KNOWN_ISAS, keys_from_pdd, keys_to_pdd, nhd_view
from shared.vllm.memory_store import MemoryStore, lookup
from shared.vllm.plan import (
    BlockLoad,
    BlockSave,
    load_hashes,
    load_span,
    matched_tokens,
    pdd_blocks_to_save,
    prompt_hashes,
    save_places,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.pdd_connector")  # under vLLM's logger, whose handlers print it


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to fill from the store before the forward, blocks
    to write to it after."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass
class _Prompt:
    """A producer's view of one running request: its prompt, pdd block hashes, vLLM blocks so
    far and pdd blocks saved."""

    num_tokens: int
    hashes: list[int]
    block_ids: list[int]
    saved: int = 0


class PddConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp > 1:  # each rank holds its share of the KV heads: under one name they would collide
            raise NotImplementedError(
                f"PddConnector stores whole blocks (every KV head) under one name: tensor parallel {tp} "
                "is not supported yet; run the engine with tensor_parallel_size=1"
            )
        name = cfg.get_from_extra_config("pdd_store", None)
        store_dir = cfg.get_from_extra_config("pdd_store_dir", None)
        if not (name or store_dir):
            raise ValueError("PddConnector needs kv_connector_extra_config 'pdd_store' or 'pdd_store_dir'")
        self.store: MemoryStore | BlockStore = lookup(name) if name else BlockStore(store_dir)
        self.model_id = str(cfg.get_from_extra_config("pdd_model_id", vllm_config.model_config.model))
        self.block_size = vllm_config.cache_config.block_size
        self.producer = cfg.is_kv_producer
        self.consumer = cfg.is_kv_consumer
        # scheduler side
        self._matched: dict[str, tuple[list[int], int]] = {}  # req -> (pdd block hashes, tokens matched)
        self._loads: list[BlockLoad] = []
        self._prompts: dict[str, _Prompt] = {}
        # worker side
        self._layers: list[torch.Tensor] = []
        self._copies = DeviceBlocks("NHD")
        self._load_errors: set[int] = set()

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.consumer or not request.prompt_token_ids:
            return 0, False
        prompt = request.prompt_token_ids
        hashes = prompt_hashes(prompt, self.model_id)
        matched = matched_tokens(
            hashes, self.store.held_run, len(prompt), self.block_size, num_computed_tokens
        )
        self._matched[request.request_id] = (hashes, matched)
        return max(0, matched - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        hashes, matched = self._matched[request.request_id]
        span = load_span(matched, num_external_tokens, self.block_size)
        block_ids = blocks.get_block_ids()[0]
        self._loads.append(
            BlockLoad(
                request.request_id, [block_ids[j] for j in span], load_hashes(hashes, span, self.block_size)
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PddConnectorMetadata(loads=self._loads)
        self._loads = []
        if not self.producer:
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            if not new.prompt_token_ids:
                continue
            hashes = prompt_hashes(new.prompt_token_ids, self.model_id)
            self._prompts[new.req_id] = _Prompt(len(new.prompt_token_ids), hashes, list(new.block_ids[0]))
            self._plan_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prompt = self._prompts.get(req_id)
            if prompt is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # a resumed request's blocks are all new
                prompt.block_ids, prompt.saved = [], 0
            if new_ids is not None:
                prompt.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _plan_save(
        self, meta: PddConnectorMetadata, req_id: str, computed: int, scheduler_output: SchedulerOutput
    ) -> None:
        prompt = self._prompts[req_id]
        after = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        span = pdd_blocks_to_save(len(prompt.hashes), prompt.num_tokens, after, prompt.saved)
        if span:
            places = save_places(span, self.block_size)
            meta.saves.append(
                BlockSave(
                    req_id,
                    [prompt.block_ids[j] for j, _ in places],
                    [sub for _, sub in places],
                    [prompt.hashes[i] for i in span],
                )
            )
            prompt.saved = span.stop
        if prompt.saved == len(prompt.hashes):  # the whole prompt is out: nothing more to follow
            del self._prompts[req_id]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        self._prompts.pop(request.request_id, None)
        return False, None  # saves were done in the step that computed them

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        first = ordered[0][1]
        if first.device.type != "cpu":
            raise NotImplementedError("PddConnector knows only the block layout of vLLM's CPU backend so far")
        isa = _cpu_attention_isa(first, self._vllm_config.cache_config.cache_dtype)
        if isa not in KNOWN_ISAS:
            raise NotImplementedError(
                f"PddConnector: the KV block layout of CPU kernels {isa!r} is not known yet"
            )
        self._layers = [nhd_view(t) for _, t in ordered]
        logger.info(
            "PddConnector: %d layers of %s (as %s), store %s",
            len(self._layers),
            tuple(ordered[0][1].shape),
            tuple(self._layers[0].shape),
            self.store,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddConnectorMetadata)
        for load in meta.loads:
            try:
                pieces = torch.cat([self.store.get(h) for h in load.hashes], dim=3)  # [L, 2, 1, tokens, ...]
            except (KeyError, ValueError) as e:  # gone or unreadable since it was matched
                logger.warning("PddConnector: request %s cannot load its blocks: %s", load.req_id, e)
                self._load_errors.update(load.block_ids)
                continue
            layers, two, _, _, heads, dim = pieces.shape
            host = pieces.view(layers, two, len(load.block_ids), self.block_size, heads, dim)
            self._copies.scatter(keys_from_pdd(host), self._layers, load.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # wait_for_save copies every layer at once, after the step's forward

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PddConnectorMetadata)
        for save in meta.saves:
            todo = [
                (b, sub, h)
                for b, sub, h in zip(save.block_ids, save.subs, save.hashes, strict=True)
                if not self.store.has(h)
            ]
            if not todo:
                continue
            ids = list(dict.fromkeys(b for b, _, _ in todo))  # each vLLM block once, in order
            at = {b: i for i, b in enumerate(ids)}
            copy = self._copies.gather(self._layers, ids)
            copy.wait()
            try:
                keys_to_pdd(copy.host)  # whole vLLM blocks: a head's keys are transposed per block
                for b, sub, h in todo:
                    tokens = slice(sub * PDD_BLOCK_SIZE, (sub + 1) * PDD_BLOCK_SIZE)
                    self.store.put(h, copy.host[:, :, at[b] : at[b] + 1, tokens])
            finally:
                copy.release()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _cpu_attention_isa(layer: torch.Tensor, cache_dtype: str) -> str:
    """The kernels vLLM's CPU attention picks for this cache (they decide a block's interior)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, _, block_size, both = layer.shape
    return _get_attn_isa(layer.dtype, block_size, both // 2, cache_dtype)
