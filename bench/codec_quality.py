"""What a lossy WAN KV codec costs in quality and buys in bytes, on the model itself.

For each prompt (random token ids on a preset's byte vocabulary; on a trained model, with a
real tokenizer, passages of this repository's own docs, which it can read as text), an engine
prefills it and its full blocks stay in the prefix cache; their KV is
exported (what prefill sends) and, for each codec, written back round-tripped through it (what
a main decoder would hold). The engine then decodes from that cache, the prompt's partial tail
block recomputed over it as MD's extend pass would, the exact path's reference being the same
run over the exact KV:
- teacher-forced, every step fed the exact path's greedy token: the mean KL(exact || codec) of
  the next-token distributions and the share of steps whose top token agrees;
- free-running greedy: the share of generated tokens identical to the exact path's, position
  by position, and how many come before the first difference.
A control row ("noise") moves every KV value by a relative 2^-8 (about bf16's own rounding):
how sensitive the model is to any perturbation of its KV, to read the codecs' figures against.
Bytes: the exported KV's size over its encoded size (what crosses the WAN). Throughput: encode
and decode of a group of the model's blocks on this host, engine bytes per second, one thread.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine, SamplingParams
from shared.kv.codec import CODECS, EXACT, decode, encode
from shared.model.tokenizer import ByteTokenizer

LOSSY = [c for c in CODECS if c != EXACT]


class _Logits:
    """Records each step's next-token log-probabilities of the one request running; with
    `force`, makes step i's argmax force[i] (after recording), so the context follows it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.model = engine.model
        self.orig: Callable[[torch.Tensor], torch.Tensor] = engine.model.compute_logits
        self.rows: list[torch.Tensor] = []
        self.force: list[int] | None = None
        self.model.compute_logits = self._hook  # the runner calls it once a step for our request

    def _hook(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.orig(hidden)
        assert logits.shape[0] == 1, "one request at a time"
        self.rows.append(torch.log_softmax(logits[-1].float(), dim=-1).cpu())
        if self.force is not None:
            logits = logits.clone()
            logits[-1, self.force[len(self.rows) - 1]] = logits[-1].max() + 1e4
        return logits


def _generate(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    rid = f"q-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        out += [o.token_id for o in engine.step() if o.rid == rid and o.token_id is not None]
    return out


DOCS = Path(__file__).resolve().parents[1]


def _prompts(engine: LLMEngine, n: int, length: int, rng: random.Random) -> list[list[int]]:
    tok, vocab = engine.tokenizer, engine.model_config.vocab_size
    if isinstance(tok, ByteTokenizer):
        return [[rng.randrange(3, min(vocab, 32000)) for _ in range(length)] for _ in range(n)]
    text = "\n\n".join(p.read_text() for p in sorted([DOCS / "README.md", *(DOCS / "docs").glob("*.md")]))
    ids = tok.encode(text, add_special_tokens=False)
    starts = [rng.randrange(0, len(ids) - length) for _ in range(n)]
    return [ids[s : s + length] for s in starts]


def _run(engine: LLMEngine, rec: _Logits, prompt: list[int], n: int, force: list[int] | None):
    rec.rows, rec.force = [], force
    tokens = _generate(engine, prompt, n)
    rec.force = None
    assert len(rec.rows) == n, f"{len(rec.rows)} logits rows for {n} tokens"
    return tokens, torch.stack(rec.rows)


def _write_blocks(engine: LLMEngine, hashes: list[int], kv: torch.Tensor) -> None:
    """Overwrite cached blocks in place (what an import of decoded KV would have put there)."""
    bids = [engine.pool.block_of(h) for h in hashes]
    assert all(b is not None for b in bids), "a prompt block left the cache"
    index = torch.tensor(bids, dtype=torch.long, device=engine.kv_cache.device)
    engine.kv_cache.index_copy_(2, index, kv.to(engine.kv_cache.device, engine.kv_cache.dtype))


def _agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    same = [x == y for x, y in zip(a, b, strict=True)]
    first = same.index(False) if False in same else len(same)
    return sum(same) / len(same), first


def throughput(kv: torch.Tensor, codecs: list[str], repeat: int = 3) -> dict[str, dict[str, float]]:
    """Encode and decode rates of `kv` (engine bytes per second, best of `repeat`), one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for codec in codecs:
            enc_s, dec_s = [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                e = encode(codec, kv)
                t1 = time.perf_counter()
                decode(codec, e.data, e.shape, e.dtype)
                dec_s.append(time.perf_counter() - t1)
                enc_s.append(t1 - t0)
            out[codec] = {
                "encode_bytes_per_s": kv.nbytes / min(enc_s),
                "decode_bytes_per_s": kv.nbytes / min(dec_s),
            }
        return out
    finally:
        torch.set_num_threads(threads)


SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NOISE = "noise"  # a control row: every value x (1 +- 2^-8), about bf16's own rounding


def _noise(kv: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    sign = torch.randint(0, 2, kv.shape, generator=gen).float() * 2 - 1
    return (kv.float() * (1 + sign * 2**-8)).to(kv.dtype)


def _score(
    engine: LLMEngine, rec: _Logits, prompt: list[int], hashes: list[int], kv: torch.Tensor, ref: tuple
) -> tuple[float, float, float, int]:
    """Decode from `kv` in the prompt's cached blocks: (mean KL, top-1 share, greedy share,
    greedy tokens before the first difference) against the exact path's `ref`."""
    ref_tokens, ref_lp = ref
    _write_blocks(engine, hashes, kv)
    _, lp = _run(engine, rec, prompt, len(ref_tokens), ref_tokens)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
    top1 = (lp.argmax(-1) == ref_lp.argmax(-1)).float().mean().item()
    free, _ = _run(engine, rec, prompt, len(ref_tokens), None)
    match, first = _agreement(free, ref_tokens)
    return kl, top1, match, first


def measure(
    model: ModelSettings,
    codecs: list[str] = LOSSY,
    *,
    prompts: int = 4,
    prompt_tokens: int = 256,
    new_tokens: int = 32,
    seed: int = 0,
) -> dict:
    """One model's figures for each codec and for the NOISE control (see the module's docstring)."""
    engine = LLMEngine(model, EngineSettings(kv_memory_mb=256))
    rec = _Logits(engine)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = [*codecs, NOISE]
    per: dict[str, list[tuple[float, float, float, int]]] = {c: [] for c in rows}
    exact_bytes, wire_bytes = dict.fromkeys(rows, 0), dict.fromkeys(rows, 0)
    group = None
    # A partial last block: its KV is recomputed over the cached blocks, as MD's extend does.
    for prompt in _prompts(engine, prompts, prompt_tokens + 5, rng):
        _generate(engine, prompt, 1)  # prefill: the prompt's full blocks are cached
        hashes = engine.block_hashes(prompt)
        kv = engine.exchange.export_blocks(hashes)
        group = kv if group is None else group
        ref = _run(engine, rec, prompt, new_tokens, None)  # over the exact cache
        for row in rows:
            if row == NOISE:
                received, nbytes = _noise(kv, gen), kv.nbytes
            else:
                enc = encode(row, kv)
                received, nbytes = decode(row, enc.data, enc.shape, enc.dtype), enc.nbytes
            exact_bytes[row] += kv.nbytes
            wire_bytes[row] += nbytes
            per[row].append(_score(engine, rec, prompt, hashes, received, ref))
            _write_blocks(engine, hashes, kv)  # the exact KV back for the next one
    assert group is not None
    big = group.repeat(1, 1, max(1, (16 << 20) // max(group.nbytes, 1)), 1, 1, 1)  # >= 16 MiB
    rates = throughput(big, codecs)
    out = {}
    for c in rows:
        kl, top1, match, first = zip(*per[c], strict=True)
        out[c] = {
            "bytes_ratio": exact_bytes[c] / wire_bytes[c],
            "bytes_cut": 1 - wire_bytes[c] / exact_bytes[c],
            "mean_kl": statistics.fmean(kl),
            "max_prompt_kl": max(kl),
            "top1_agreement": statistics.fmean(top1),
            "greedy_agreement": statistics.fmean(match),
            "greedy_tokens_before_first_difference": statistics.fmean(first),
            **rates.get(c, {}),
        }
    return {
        "model": "default" if model.path is None and model.preset is None else engine.model_id,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_shape_per_block": [group.shape[0], 2, *group.shape[3:]],
        "prompts": prompts,
        "prompt_tokens": prompt_tokens + 5,
        "new_tokens": new_tokens,
        "codecs": out,
    }


def print_table(results: list[dict]) -> None:
    print("\nWAN KV codecs against the exact path (teacher-forced KL and top-1; free-running greedy tokens)")
    print(
        f"  {'model':>14s} {'':>4s} {'codec':>6s} {'bytes':>7s} {'mean KL':>9s} {'top-1':>6s} {'greedy':>7s}"
        f" {'1st diff':>8s} {'enc MB/s':>9s} {'dec MB/s':>9s}"
    )
    for r in results:
        for c, f in r["codecs"].items():
            rates = (
                f" {f['encode_bytes_per_s'] / 1e6:9.0f} {f['decode_bytes_per_s'] / 1e6:9.0f}"
                if "encode_bytes_per_s" in f
                else f" {'-':>9s} {'-':>9s}"
            )
            print(
                f"  {r['model']:>14s} {SHORT.get(r['dtype'], r['dtype']):>4s} {c:>6s} {f['bytes_ratio']:6.2f}x {f['mean_kl']:9.2e}"
                f" {f['top1_agreement']:6.1%} {f['greedy_agreement']:7.1%}"
                f" {f['greedy_tokens_before_first_difference']:8.1f}{rates}"
            )
    print(f"  ({NOISE}: a control, not a codec: every KV value x (1 +- 2^-8), about bf16's own rounding)")
