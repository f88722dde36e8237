"""LLMEngine: requests in, one batched forward per step(), StepOutputs out.

Not thread-safe: the services call every method from one worker thread.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence as Seq

import torch

from shared.config import EngineSettings, ModelSettings
from shared.engine.block_pool import BlockPool
from shared.engine.errors import EngineError, InvalidRequestError
from shared.engine.hashing import block_hashes, extend_block_hashes
from shared.engine.model_runner import ModelRunner
from shared.engine.outputs import StepOutput
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, blocks_for
from shared.engine.sequence import SeqStatus, Sequence
from shared.model import load_model

log = logging.getLogger(__name__)

MODES = ("generate", "prefill", "hold")


class LLMEngine:
    def __init__(self, model_settings: ModelSettings, engine_settings: EngineSettings) -> None:
        self.model, self.model_config, self.tokenizer = load_model(model_settings)
        cfg, es = self.model_config, engine_settings
        if es.block_size < 1 or es.max_batched_tokens < 1 or es.max_num_seqs < 1:
            raise EngineError("block_size, max_batched_tokens and max_num_seqs must be >= 1")
        self.settings = es
        self.model_id = cfg.model_id
        self.block_size = es.block_size
        self.dtype = self.model.lm_head.weight.dtype
        self.device = self.model.lm_head.weight.device
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(self.dtype.itemsize)
        self.max_model_len = min(es.max_model_len, cfg.max_position_embeddings)
        num_blocks = int(es.kv_memory_mb * 2**20) // (self.block_size * self.kv_bytes_per_token)
        self.pool = BlockPool(num_blocks)
        # The pool is exactly num_blocks * block_size tokens of K and V: no other per-token state.
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=self.dtype, device=self.device,
        )  # fmt: skip
        self.scheduler = Scheduler(self.pool, es, self.model_id)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_size)
        self.sampler = Sampler()
        self.seqs: dict[str, Sequence] = {}  # every request the engine still knows
        self.pins: dict[str, list[int]] = {}  # owner -> referenced block ids
        self._outbox: list[StepOutput] = []  # produced between steps (extend of nothing)
        self._resample: list[Sequence] = []  # held seqs extended by nothing with final=True
        self._arrival = 0
        self.num_computed_tokens = 0  # tokens run through the model since start

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self, rid: str, token_ids: list[int], params: SamplingParams, *,
        num_prompt_tokens: int | None = None, mode: str = "generate",
    ) -> None:  # fmt: skip
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("request id must be a non-empty string")
        if rid in self.seqs:
            raise InvalidRequestError(f"request {rid!r} already exists")
        if mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        params.validate()
        token_ids = self._check_ids(token_ids, "prompt")
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty: give at least one token")
        npt = n if num_prompt_tokens is None else num_prompt_tokens
        if isinstance(npt, bool) or not isinstance(npt, int) or not 1 <= npt <= n:
            raise InvalidRequestError(f"num_prompt_tokens must be in [1, {n}], got {num_prompt_tokens!r}")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"{n} tokens leave no room to generate: max_model_len is {self.max_model_len}"
            )
        if mode != "prefill" and n - npt >= params.max_tokens:
            raise InvalidRequestError(f"already {n - npt} output tokens, max_tokens is {params.max_tokens}")
        # KV it may need at most: every token but the last sampled one.
        final_len = n + 1 if mode == "prefill" else min(npt + params.max_tokens, self.max_model_len)
        need = blocks_for(final_len - 1, self.block_size)
        if need > self.pool.num_blocks:
            raise InvalidRequestError(
                f"request needs up to {need} KV blocks ({final_len - 1} tokens), "
                f"the whole pool has {self.pool.num_blocks}: shorten the prompt or max_tokens"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(rid, token_ids, params, npt, mode, seed, self._arrival)
        self._arrival += 1
        self.seqs[rid] = seq
        self.scheduler.add(seq)

    def extend(self, rid: str, token_ids: list[int], *, final: bool) -> None:
        seq = self.seqs.get(rid)
        if seq is None:
            raise InvalidRequestError(f"unknown request {rid!r}")
        if seq.mode != "hold":
            raise InvalidRequestError(f"request {rid!r} is not held (mode {seq.mode!r})")
        token_ids = self._check_ids(token_ids, "extend")
        total = seq.num_tokens + len(token_ids)
        if total >= self.max_model_len:
            raise InvalidRequestError(f"extend to {total} tokens reaches max_model_len {self.max_model_len}")
        if total - seq.num_prompt_tokens >= seq.params.max_tokens:
            raise InvalidRequestError(
                f"extend to {total - seq.num_prompt_tokens} output tokens leaves nothing to generate "
                f"(max_tokens {seq.params.max_tokens})"
            )
        seq.token_ids += token_ids
        if final:
            seq.mode = "generate"
        if seq.status is not SeqStatus.HELD:
            return  # still computing: the new tokens join that work
        if token_ids:
            seq.last_logits = None
            self.scheduler.resume(seq)
        elif final:
            self._resample.append(seq)  # sample from the logits kept when it was computed
        else:
            self._outbox.append(StepOutput(rid, None, None, False, None, computed=True))

    def abort(self, rid: str) -> bool:
        self._release_pins(rid)
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return False
        self._drop(seq)
        return True

    def release(self, rid: str) -> None:
        self._release_pins(rid)
        seq = self.seqs.get(rid)
        if seq is not None and seq.mode in ("hold", "prefill"):  # a generating request keeps going
            del self.seqs[rid]
            self._drop(seq)

    # ---- stepping ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Work for step(): queued or running sequences, or outputs not yet returned.
        Held sequences and finished "prefill" ones wait for the caller and do not count."""
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
        if not batch:
            return outputs
        want = [b.seq.num_computed_tokens + b.num_new == b.seq.num_tokens for b in batch]
        try:
            logits = self.runner.run(batch, want)
        except Exception as e:  # a failed forward ends its requests, never the engine
            log.exception("forward failed")
            for b in batch:
                outputs.append(self._fail(b.seq, f"forward failed: {type(e).__name__}: {e}"))
            return outputs
        done: list[Sequence] = []
        for b, w in zip(batch, want, strict=True):
            self.num_computed_tokens += b.num_new
            b.seq.num_computed_tokens += b.num_new
            self._register_blocks(b.seq)
            if w:
                done.append(b.seq)
        to_sample: list[Sequence] = []
        rows: list[int] = []
        for i, seq in enumerate(done):
            if seq.mode == "hold":
                seq.last_logits = logits[i]
                seq.status = SeqStatus.HELD
                self.scheduler.running.remove(seq)
                outputs.append(StepOutput(seq.rid, None, None, False, None, computed=True))
            else:
                to_sample.append(seq)
                rows.append(i)
        if to_sample:
            outputs += self._sample(to_sample, logits[rows])
        return outputs

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        tokens = self.sampler(logits, [s.params for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs])
        outputs = []
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.token_ids.append(tok)
            index = seq.num_generated - 1
            reason = "prefill" if seq.mode == "prefill" else self._finish_reason(seq, tok)
            outputs.append(StepOutput(seq.rid, tok, index, reason is not None, reason))
            if reason == "prefill":
                seq.status = SeqStatus.FINISHED  # keeps its blocks until release()
                self.scheduler.running.remove(seq)
            elif reason is not None:
                self.scheduler.remove(seq)
                del self.seqs[seq.rid]
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.model_config.eos_token_ids:
            return "stop"
        if p.stop:
            # Only the tail can hold a stop string that was completed by this token.
            window = max(len(s.encode()) for s in p.stop) + 8
            tail = seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - window) :]
            text = self.tokenizer.decode(tail)
            if any(s in text for s in p.stop):
                return "stop"
        if seq.num_generated >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _register_blocks(self, seq: Sequence) -> None:
        """Hash the full blocks whose KV just got computed and put them in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        extend_block_hashes(seq.hashes, seq.token_ids, self.block_size, self.model_id)
        for i in range(seq.num_registered_blocks, full):
            h, bid = seq.hashes[i], seq.block_table[i]
            if not self.pool.register(bid, h):
                # Another block already holds this hash (a twin computed concurrently, or
                # imported): share that one and drop ours, so the hash stays cached (and
                # exportable) as long as this sequence lives.
                other = self.pool.cached[h]
                if other != bid:
                    self.pool.touch(other)
                    seq.block_table[i] = other
                    self.pool.release(bid)
        seq.num_registered_blocks = full

    def _fail(self, seq: Sequence, error: str) -> StepOutput:
        self.seqs.pop(seq.rid, None)
        self._drop(seq)
        return StepOutput(seq.rid, None, None, True, "error", error=error)

    def _drop(self, seq: Sequence) -> None:
        if seq in self._resample:
            self._resample.remove(seq)
        self._outbox = [o for o in self._outbox if o.rid != seq.rid]
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.last_logits = None

    def _check_ids(self, token_ids: Seq[int], what: str) -> list[int]:
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Seq | torch.Tensor):
            raise InvalidRequestError(f"{what} token ids must be a list of integers")
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"{what} token ids must be integers, got {t!r}")
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"{what} token id {t} is out of the vocabulary [0, {vocab})")
        return ids

    # ---- prefix cache and KV transfer -------------------------------------------------
    def generated_token_ids(self, rid: str) -> list[int]:
        seq = self.seqs.get(rid)
        if seq is None:
            raise InvalidRequestError(f"unknown request {rid!r}")
        return seq.generated_token_ids()

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        return block_hashes(token_ids, self.block_size, self.model_id)

    def computed_block_hashes(self, rid: str) -> list[int]:
        seq = self.seqs.get(rid)
        if seq is None:
            return []
        full = min(seq.num_computed_tokens // self.block_size, seq.num_registered_blocks)
        return seq.hashes[:full]

    def num_cached_prefix_blocks(self, hashes: list[int]) -> int:
        return len(self.pool.lookup(hashes))

    def pin_blocks(self, owner: str, hashes: list[int]) -> int:
        bids = self.pool.lookup(hashes)
        for bid in bids:
            self.pool.touch(bid)
        if bids:
            self.pins.setdefault(owner, []).extend(bids)
        return len(bids)

    def _release_pins(self, owner: str) -> None:
        for bid in reversed(self.pins.pop(owner, [])):
            self.pool.release(bid)

    def export_blocks(self, hashes: list[int]) -> torch.Tensor:
        bids = []
        for h in hashes:
            bid = self.pool.cached.get(h)
            if bid is None:
                raise EngineError(f"block {h} is not cached")
            bids.append(bid)
        index = torch.tensor(bids, dtype=torch.long, device=self.device)
        return self.kv_cache.index_select(2, index).cpu().contiguous()

    @torch.inference_mode()
    def import_blocks(self, hashes: list[int], kv: torch.Tensor, *, pin: str | None = None) -> int:
        cfg = self.model_config
        shape = (cfg.num_layers, 2, len(hashes), self.block_size, cfg.num_kv_heads, cfg.head_dim)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != shape:
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise EngineError(f"KV shape {got} does not match the expected {shape}")
        if kv.dtype != self.dtype:
            raise EngineError(f"KV dtype {kv.dtype} does not match the engine dtype {self.dtype}")
        present = [self.pool.cached[h] for h in dict.fromkeys(hashes) if h in self.pool.cached]
        new: dict[int, int] = {}  # hash -> position in kv, first occurrence
        for i, h in enumerate(hashes):
            if h not in self.pool.cached and h not in new:
                new[h] = i
        cost = len(new) + self.pool.cost_of(present)
        if cost > self.pool.num_free:
            raise EngineError(f"no free KV block for import: {len(new)} new blocks, {self.pool.num_free} free")
        for bid in present:  # hold them, so allocating the new ones cannot evict them
            self.pool.touch(bid)
        bids = [self.pool.allocate() for _ in new]
        if bids:
            src = kv[:, :, list(new.values())].to(self.device)
            self.kv_cache.index_copy_(2, torch.tensor(bids, dtype=torch.long, device=self.device), src)
            for bid, h in zip(bids, new, strict=True):
                self.pool.register(bid, h)
        held = present + bids
        if pin is not None:
            self.pins.setdefault(pin, []).extend(held)  # our references become the pin's
        else:
            for bid in reversed(held):
                self.pool.release(bid)
        return len(bids)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody references (benchmarks, operators); returns how many."""
        return self.pool.evict_unreferenced()

    def drain_events(self) -> list[tuple[str, int]]:
        return self.pool.drain_events()

    def cached_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now (a snapshot for peers that lost events)."""
        return list(self.pool.cached)

    def stats(self) -> dict:
        statuses = [s.status for s in self.seqs.values()]
        return {
            "num_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.num_free,
            "used_blocks": self.pool.num_blocks - self.pool.num_free,
            "cached_blocks": len(self.pool.cached),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "held": statuses.count(SeqStatus.HELD),
            "retained": statuses.count(SeqStatus.FINISHED),
            "pinned_blocks": sum(len(b) for b in self.pins.values()),
            "preemptions": self.scheduler.num_preemptions,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "computed_tokens": self.num_computed_tokens,
            "prefix_hit_tokens": self.scheduler.num_hit_tokens,
        }

