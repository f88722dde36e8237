"""LLMEngine: requests in, one batched forward per step(), StepOutputs out.

The engine keeps the requests and drives the pieces: RequestIntake checks what comes in,
the Scheduler owns queues and block tables, the ModelRunner computes, the Sampler draws,
finish_reason decides when a request ends, and BlockExchange (engine.exchange) moves and pins
KV blocks by hash. Not thread-safe: the services call every method from one worker thread.
The services see it through the engine seam (shared/engine/seam.py): its block calls go to
the exchange (ExchangeCalls, shared/engine/exchange_calls.py).
"""

from __future__ import annotations

import logging

import torch

from shared.config import EngineSettings, ModelSettings
from shared.engine.block_exchange import BlockExchange
from shared.engine.block_pool import BlockPool
from shared.engine.errors import EngineError, InvalidRequestError
from shared.engine.exchange_calls import ExchangeCalls
from shared.engine.grammar import Grammars
from shared.engine.hashing import block_hashes
from shared.engine.intake import RequestIntake
from shared.engine.kv_admission import request_blocks
from shared.engine.kv_memory import available_bytes, kv_pool_bytes, vllm_pool_bytes
from shared.engine.logprobs import sampled_logprobs
from shared.engine.model_runner import ModelRunner
from shared.engine.outputs import EngineStats, FinishReason, StepOutput
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledSeq, Scheduler
from shared.engine.sequence import Mode, SeqStatus, Sequence
from shared.engine.step_logits import collect_prompt_logprobs, processed_logits
from shared.engine.stopping import finish_reason
from shared.model import load_model
from shared.model.config import context_limit
from shared.model.fused import choose_fused_ops
from shared.model.packed_linear import choose_linear_backend

log = logging.getLogger(__name__)


class LLMEngine(ExchangeCalls):
    def __init__(self, model_settings: ModelSettings, engine_settings: EngineSettings) -> None:
        self.model, self.model_config, self.tokenizer = load_model(model_settings)
        cfg, es = self.model_config, engine_settings
        if es.block_size < 1 or es.max_batched_tokens < 1 or es.max_num_seqs < 1:
            raise EngineError("block_size, max_batched_tokens and max_num_seqs must be >= 1")
        self.settings = es
        self.model_id = cfg.model_id
        self.block_size = es.block_size
        embed = self.model.model.embed_tokens.weight
        self.dtype, self.device = embed.dtype, embed.device
        self.linear_backend = choose_linear_backend(self.model, es.linear_backend)
        self.small_ops = choose_fused_ops(self.model, es.small_ops)
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(self.dtype.itemsize)
        try:
            self.max_model_len = context_limit(cfg, es.max_model_len)
        except ValueError as e:
            raise EngineError(str(e)) from None
        budget = kv_pool_bytes(
            es.kv_memory_mb,
            es.kv_memory_fraction,
            lambda: available_bytes(self.device),
            lambda: vllm_pool_bytes(self.device, es.kv_cache_space_gib, es.gpu_memory_utilization),
        )
        num_blocks = budget // (self.block_size * self.kv_bytes_per_token)
        self.pool = BlockPool(num_blocks)
        # The pool is exactly num_blocks * block_size tokens of K and V: no other per-token state.
        # zeros, not empty: padded decode attention reads unwritten slots, and garbage there
        # (NaN) would leak through a zero weight. So the whole pool is committed at start.
        self.kv_cache = torch.zeros(
            cfg.num_layers,
            2,
            num_blocks,
            self.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.intake = RequestIntake(cfg.vocab_size, self.max_model_len, self.block_size, num_blocks)
        self.scheduler = Scheduler(self.pool, es, self.model_id)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_size, es.attention_backend)
        share_kernel_helpers(es, self.linear_backend, self.runner.backend.name, self.small_ops)
        self.sampler = Sampler()
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        self.exchange = BlockExchange(self.pool, self.kv_cache)
        log.info("KV pool: %d blocks of %d tokens (%.0f MB)", num_blocks, self.block_size, budget / 2**20)
        self.seqs: dict[str, Sequence] = {}  # every request the engine still knows
        self._outbox: list[StepOutput] = []  # produced between steps (extend of nothing)
        self._resample: list[Sequence] = []  # held seqs extended by nothing with final=True

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
        seq = self.intake.new_sequence(
            rid, token_ids, params, num_prompt_tokens=num_prompt_tokens, mode=mode, taken=self.seqs
        )
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured)
            seq.grammar.catch_up(seq.generated_token_ids())  # refuses output the grammar does not allow
        self.seqs[rid] = seq
        self.scheduler.add(seq)

    def extend(self, rid: str, token_ids: list[int], *, final: bool) -> None:
        """Append tokens to a HOLD request and compute them; final=True then generates."""
        seq = self._known(rid)
        token_ids = self.intake.check_extend(seq, token_ids)
        seq.token_ids += token_ids
        if final:
            seq.mode = Mode.GENERATE
        if seq.status is not SeqStatus.HELD:
            return  # still computing: the new tokens join that work
        if token_ids:
            seq.last_logits = None
            self.scheduler.resume(seq)
        elif final:
            self._resample.append(seq)  # sample from the logits kept when it was computed
        else:
            self._outbox.append(StepOutput(rid=rid, computed=True))

    def abort(self, rid: str) -> bool:
        """Drop the request in any state; False if unknown. Pins are not touched."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return False
        self._drop(seq)
        return True

    def release(self, rid: str) -> None:
        """Drop a HOLD or PREFILL request; a generating one keeps going. Pins are not touched."""
        seq = self.seqs.get(rid)
        if seq is not None and seq.mode in (Mode.HOLD, Mode.PREFILL):
            del self.seqs[rid]
            self._drop(seq)

    def generated_token_ids(self, rid: str) -> list[int]:
        return self._known(rid).generated_token_ids()

    def computed_block_hashes(self, rid: str) -> list[int]:
        """Hashes of the request's full blocks whose KV is computed (all in the prefix cache)."""
        seq = self.seqs.get(rid)
        return [] if seq is None else seq.hashes[: seq.num_computed_tokens // self.block_size]

    def lifetime_blocks(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """KV blocks a request of this prompt length may hold until it finishes."""
        return request_blocks(num_prompt_tokens, params.max_tokens, self.max_model_len, self.block_size)

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        return block_hashes(token_ids, self.block_size, self.model_id)

    # ---- stepping ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Work for step(): queued or running sequences, or outputs not yet returned.
        Held sequences and prefilled ones wait for the caller and do not count."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._outbox or self._resample)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs, self._outbox = self._outbox, []
        if self._resample:
            seqs, self._resample = self._resample, []
            logits = torch.stack([s.last_logits for s in seqs])  # type: ignore[misc]
            for seq in seqs:
                seq.last_logits = None
                self.scheduler.resume(seq)
            outputs += self._sample(seqs, logits)
        batch = self.scheduler.schedule()
        if batch:
            outputs += self._forward(batch)
        return outputs

    def _forward(self, batch: list[ScheduledSeq]) -> list[StepOutput]:
        """One forward over the batch; sequences with all their KV computed sample (or hold)."""
        want = [b.seq.num_computed_tokens + b.num_new == b.seq.num_tokens for b in batch]
        every = [b.seq.prompt_logprobs is not None for b in batch]
        try:
            logits, chunk_logits = self.runner.run(batch, want, every)
        except Exception as e:  # a failed forward ends its requests, never the engine
            log.exception("forward failed")
            return [self._fail(b.seq, f"forward failed: {type(e).__name__}: {e}") for b in batch]
        for j, rows in chunk_logits.items():
            collect_prompt_logprobs(batch[j], rows)
        for b in batch:
            self.scheduler.commit(b)
        done = [b.seq for b, w in zip(batch, want, strict=True) if w]  # one logits row each
        outputs = []
        for seq, row in zip(done, logits, strict=True):
            if seq.mode is Mode.HOLD:
                seq.last_logits = row
                self.scheduler.hold(seq)
                outputs.append(StepOutput(rid=seq.rid, computed=True))
        rows = [i for i, seq in enumerate(done) if seq.mode is not Mode.HOLD]
        if rows:
            outputs += self._sample([done[i] for i in rows], logits[rows])
        return outputs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        positions = [s.num_tokens for s in seqs]
        processed = processed_logits(seqs, logits, self.model_config.eos_token_ids)
        tokens = self.sampler(processed, [s.params for s in seqs], [s.seed for s in seqs], positions)
        lps = sampled_logprobs(logits, tokens, [s.params.logprobs for s in seqs])
        outputs = []
        for seq, tok, lp in zip(seqs, tokens, lps, strict=True):
            seq.token_ids.append(tok)
            reason = FinishReason.PREFILLED if seq.mode is Mode.PREFILL else self._finish_reason(seq)
            index = seq.num_generated - 1
            prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None  # they go with output 0
            outputs.append(
                StepOutput(
                    rid=seq.rid,
                    token_id=tok,
                    index=index,
                    finished=reason is not None,
                    finish_reason=reason,
                    ends=self._finish_reason(seq) if reason is FinishReason.PREFILLED else None,
                    logprobs=lp,
                    prompt_logprobs=prompt_lps,
                )
            )
            if reason is FinishReason.PREFILLED:
                self.scheduler.park_prefilled(seq)
            elif reason is not None:
                self.scheduler.remove(seq)
                del self.seqs[seq.rid]
        return outputs

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        return finish_reason(
            seq.token_ids,
            seq.num_prompt_tokens,
            seq.params,
            eos_token_ids=self.model_config.eos_token_ids,
            decode=self.tokenizer.decode,
            max_model_len=self.max_model_len,
        )

    def _fail(self, seq: Sequence, error: str) -> StepOutput:
        self.seqs.pop(seq.rid, None)
        self._drop(seq)
        return StepOutput(rid=seq.rid, finished=True, finish_reason=FinishReason.ERROR, error=error)

    def _drop(self, seq: Sequence) -> None:
        if seq in self._resample:
            self._resample.remove(seq)
        self._outbox = [o for o in self._outbox if o.rid != seq.rid]
        self.scheduler.remove(seq)
        seq.last_logits = None

    def _known(self, rid: str) -> Sequence:
        seq = self.seqs.get(rid)
        if seq is None:
            raise InvalidRequestError(f"unknown request {rid!r}")
        return seq

    def stats(self) -> EngineStats:
        statuses = [s.status for s in self.seqs.values()]
        pool = self.pool
        return EngineStats(
            num_blocks=pool.num_blocks,
            free_blocks=pool.num_free,
            used_blocks=pool.num_blocks - pool.num_free,
            cached_blocks=pool.num_cached,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            held=statuses.count(SeqStatus.HELD),
            prefilled=statuses.count(SeqStatus.PREFILLED),
            pinned_blocks=self.exchange.num_pinned_blocks,
            preemptions=self.scheduler.num_preemptions,
            kv_bytes_per_token=self.kv_bytes_per_token,
            computed_tokens=self.scheduler.num_computed_tokens,
            prefix_hit_tokens=self.scheduler.num_hit_tokens,
            prefix_query_tokens=self.scheduler.num_queried_tokens,
            pending_tokens=self.scheduler.pending_tokens(),
        )

    def num_requests(self) -> int:
        return len(self.seqs)


def share_kernel_helpers(es: EngineSettings, linear_backend: str, attention: str, small_ops: str) -> None:
    """The kernels' low-priority helper threads: one pool, in the first kernel library in
    use, that the others share (per process: the last engine's choice)."""
    from shared.model.kernels import fused_ops, paged_attention_ops, panel_linear_ops

    libs = [panel_linear_ops() if linear_backend == "panel" else None]
    libs.append(paged_attention_ops() if attention == "paged" else None)
    libs.append(fused_ops() if small_ops == "fused" else None)
    libs = [ops for ops in libs if ops is not None]
    if not libs:
        return
    owner, *others = libs
    owner.set_helpers(es.helper_threads, es.helper_nice)
    for ops in others:
        ops.share_helpers(owner.helpers_capsule())
    if es.helper_threads:
        log.info("kernels: %d helper thread(s) at niceness %d", es.helper_threads, es.helper_nice)
