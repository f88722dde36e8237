"""VllmEngine: vLLM's v1 engine behind pdd's engine seam (shared/engine/seam.py), so prefill,
relay and main decode run on it unchanged (`--engine vllm`, PDD_ENGINE=vllm).

vLLM runs in this process (its engine core in process, one worker) with PddConnector as kv_both
on a MemoryStore of pdd's 16-token blocks (shared/vllm/memory_store.py):
- a prompt vLLM computes is saved to the store block by block (the connector), so P exports it
  from there, and a block the bulk channel brings (import_blocks) lands there, so RLD and MD
  load it into vLLM's paged cache when their request is scheduled (vLLM's own prefix cache
  first; the connector fills the whole vLLM blocks after its hit, vLLM computes the rest);
- every request is one or more vLLM requests over the request's whole token list: PREFILL and
  a HOLD batch's compute are requests of one output token (the token is kept for PREFILL and
  dropped for HOLD), GENERATE the rest of the output. A handoff's MD request is the prompt plus
  RLD's tokens: the prompt's blocks come from the store, vLLM computes the handed-over tokens.
- the store's LRU, pins and events are the decode-side prefix cache as the services and the
  routers see it.

What it does not do (pdd's engine does): the RDMA path's slots, structured outputs and
presence/frequency penalties across a handoff (vLLM counts them over its output only).
"""

from __future__ import annotations

import itertools
import os

import torch

from shared.config import EngineSettings, ModelSettings
from shared.engine.errors import EngineError, InvalidRequestError
from shared.engine.hashing import block_hashes
from shared.engine.kv_admission import request_blocks
from shared.engine.outputs import EngineStats, StepOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.seam import BlockFormat
from shared.engine.sequence import Mode
from shared.kv.vllm_blocks import PDD_BLOCK_SIZE
from shared.model.config import context_limit
from shared.model.describe import describe_model
from shared.vllm.checkpoint import vllm_checkpoint
from shared.vllm.memory_store import MemoryStore
from shared.vllm.requests import Logprobs, Next, VllmRequest, on_output, output_budget
from shared.vllm.sampling import to_vllm_sampling_params
from shared.vllm.store_calls import StoreCalls

# vLLM's blocks on the CPU: the smallest its attention kernels take (128 is its default). A
# handed-over prompt's tail short of a whole vLLM block is computed again where it lands.
CPU_BLOCK_SIZE = 32
_built = False  # vLLM keeps one KV connector per process: a second engine would share the first's


class VllmEngine(StoreCalls):
    def __init__(self, model: ModelSettings, settings: EngineSettings) -> None:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        global _built
        if _built:
            raise EngineError("one vLLM engine per process: vLLM keeps one KV connector per process")
        _built = True
        info = describe_model(model)
        cfg = info.config
        self.model_id = info.model_id
        self.block_size = PDD_BLOCK_SIZE
        self.max_model_len = context_limit(cfg, settings.max_model_len)
        self.dtype = torch.float32 if model.dtype in ("auto", "float32") else getattr(torch, model.dtype)
        self._format = BlockFormat(
            self.dtype, (cfg.num_layers, 2, PDD_BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        )
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(self.dtype.itemsize)
        # vLLM's paged cache and the store each get the engine's KV space
        space = int(settings.kv_cache_space_gib * 2**30)
        self.store = MemoryStore(max(1, space // (self.kv_bytes_per_token * PDD_BLOCK_SIZE)))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the store is this process's
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(settings.kv_cache_space_gib))))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # pdd's launcher shares the cores
        args = EngineArgs(
            model=str(vllm_checkpoint(model, info)),
            served_model_name=self.model_id,
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            block_size=CPU_BLOCK_SIZE if model.device == "cpu" else None,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max(settings.max_batched_tokens, self.max_model_len),
            seed=model.seed,
            enforce_eager=True,
            enable_prefix_caching=True,
            disable_log_stats=True,
            kv_transfer_config=KVTransferConfig(
                kv_connector="PddConnector",
                kv_connector_module_path="shared.vllm.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",  # a block gone since it matched is computed
                kv_connector_extra_config={"pdd_store": self.store.name, "pdd_model_id": self.model_id},
            ),
        )
        self.llm = LLMEngine.from_engine_args(args)
        # vLLM's CPU attention plans for the torch threads it set here; OpenMP's count is per
        # thread, and steps run on the service's engine thread
        self._threads = torch.get_num_threads()
        self._requests: dict[str, VllmRequest] = {}
        self._by_vllm: dict[str, VllmRequest] = {}
        self._outbox: list[StepOutput] = []
        self._ids = itertools.count()
        self._computed_tokens = self._hit_tokens = self._query_tokens = 0

    def block_format(self) -> BlockFormat:
        return self._format

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
        if rid in self._requests:
            raise InvalidRequestError(f"request {rid!r} exists already")
        num_prompt = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        if not 0 < num_prompt <= len(token_ids):
            raise InvalidRequestError(f"{num_prompt} prompt tokens of {len(token_ids)}")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"{len(token_ids)} tokens leave no room under max_model_len {self.max_model_len}"
            )
        hashes = block_hashes(token_ids[:num_prompt], PDD_BLOCK_SIZE, self.model_id)
        req = VllmRequest(rid, list(token_ids), num_prompt, params, mode, hashes)
        self._submit(req)  # raises before the request is known when vLLM refuses it
        self._requests[rid] = req

    def extend(self, rid: str, token_ids: list[int], *, final: bool) -> None:
        req = self._known(rid)
        if req.mode is not Mode.HOLD:
            raise InvalidRequestError(f"request {rid!r} is not held: it cannot be extended")
        if len(req.tokens) + len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(f"extending {rid!r} passes max_model_len {self.max_model_len}")
        req.tokens += token_ids
        if final:
            req.mode = Mode.GENERATE
        if req.running is None:
            if token_ids or final:
                self._submit(req)
            else:
                self._outbox.append(StepOutput(rid=rid, computed=True))

    def abort(self, rid: str) -> bool:
        req = self._requests.pop(rid, None)
        if req is None:
            return False
        self._stop(req)
        return True

    def generated_token_ids(self, rid: str) -> list[int]:
        req = self._known(rid)
        return req.tokens[req.num_prompt :]

    def computed_block_hashes(self, rid: str) -> list[int]:
        req = self._requests.get(rid)
        return [] if req is None else req.hashes[: self.store.held_run(req.hashes)]

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        return block_hashes(token_ids, PDD_BLOCK_SIZE, self.model_id)

    def lifetime_blocks(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return request_blocks(num_prompt_tokens, params.max_tokens, self.max_model_len, PDD_BLOCK_SIZE)

    # ---- stepping ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._outbox) or self.llm.has_unfinished_requests()

    def step(self) -> list[StepOutput]:
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        outputs, self._outbox = self._outbox, []
        stepped = [req for req in self._by_vllm.values() if req.running_mode is Mode.PREFILL]
        for out in self.llm.step():
            req = self._by_vllm.get(out.request_id)
            if req is None:
                continue
            if not req.counted and out.num_cached_tokens is not None:
                self._count(req, out.num_cached_tokens)
            completion = out.outputs[0] if out.outputs else None
            tokens = list(completion.token_ids) if completion else []
            reason = completion.finish_reason if completion else None
            lps = Logprobs(completion.logprobs if completion else None, out.prompt_logprobs)
            outs, then = on_output(req, tokens, out.finished, reason, self.max_model_len, lps)
            outputs += outs
            if out.finished:
                self._by_vllm.pop(out.request_id, None)
            if then is Next.SUBMIT:
                self._submit(req)
            elif then is Next.FORGET:
                self._requests.pop(req.rid, None)
        # the blocks this step saved for a prefill wait for its export (only a running
        # prefill's step saves any)
        for req in stepped:
            if req.rid in self._requests:
                self.store.pin(_prefill_owner(req.rid), req.hashes)
        return outputs

    def _submit(self, req: VllmRequest) -> None:
        """A vLLM request over the request's tokens: one output token for PREFILL and HOLD, the
        rest of the output for GENERATE."""
        from vllm.sampling_params import RequestOutputKind

        generated = len(req.tokens) - req.num_prompt
        try:
            params = to_vllm_sampling_params(req.params, generated=generated)
        except EngineError:
            raise
        except Exception as e:  # vLLM's own checks of the parameters
            raise InvalidRequestError(f"vLLM refuses the sampling parameters: {e}") from None
        params.max_tokens, params.min_tokens = output_budget(
            req, params.max_tokens, params.min_tokens, self.max_model_len
        )
        params.output_kind = RequestOutputKind.DELTA
        vid = f"{req.rid}@{next(self._ids)}"
        try:
            self.llm.add_request(vid, {"prompt_token_ids": list(req.tokens)}, params)
        except Exception as e:  # vLLM validates the prompt (vocabulary, length) and the params
            raise InvalidRequestError(f"vLLM refuses the request: {e}") from None
        self._by_vllm[vid] = req
        req.running, req.running_mode, req.sent, req.counted = vid, req.mode, len(req.tokens), False

    def _stop(self, req: VllmRequest) -> None:
        if req.running is not None:
            self.llm.abort_request([req.running])
            self._by_vllm.pop(req.running, None)
            req.running = None
        self.store.unpin(_prefill_owner(req.rid))

    def _count(self, req: VllmRequest, cached: int) -> None:
        """A vLLM request's prompt, once: what its prefix cache and the store gave, what it computed."""
        req.counted = True
        self._query_tokens += req.sent
        self._hit_tokens += min(cached, req.sent)
        self._computed_tokens += req.sent - min(cached, req.sent)

    def _known(self, rid: str) -> VllmRequest:
        try:
            return self._requests[rid]
        except KeyError:
            raise EngineError(f"unknown request {rid!r}") from None

    def vllm_blocks_in_use(self) -> int:
        """Blocks of vLLM's paged cache that running requests hold (cached free ones are not)."""
        pool = self.llm.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # less its null block

    def stats(self) -> EngineStats:
        """In pdd's 16-token blocks: the store's room, its pinned blocks and vLLM's blocks in use."""
        reqs = list(self._requests.values())
        ratio = self.llm.vllm_config.cache_config.block_size // PDD_BLOCK_SIZE
        pinned = self.store.pinned_blocks
        return EngineStats(
            num_blocks=self.store.capacity,
            free_blocks=self.store.capacity - pinned,
            used_blocks=pinned + self.vllm_blocks_in_use() * ratio,
            cached_blocks=len(self.store),
            running=sum(r.running is not None and r.mode is Mode.GENERATE for r in reqs),
            waiting=0,
            held=sum(r.mode is Mode.HOLD for r in reqs),
            prefilled=sum(r.prefilled for r in reqs),
            pinned_blocks=pinned,
            preemptions=0,
            kv_bytes_per_token=self.kv_bytes_per_token,
            computed_tokens=self._computed_tokens,
            prefix_hit_tokens=self._hit_tokens,
            prefix_query_tokens=self._query_tokens,
            pending_tokens=sum(r.sent for r in reqs if r.running is not None and r.generated == 0),
        )

    def num_requests(self) -> int:
        return len(self._requests)

    # ---- the prefix cache as the routers follow it ---------------------------------------------
    def forget_cached(self) -> None:
        """Drop every cached block nobody pins: vLLM's prefix cache and the store's."""
        self.llm.reset_prefix_cache()
        self.store.clear()


def _prefill_owner(rid: str) -> str:
    return f"{rid}#prefill"
