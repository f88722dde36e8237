"""Constrained-decoding cost: TPOT with a JSON schema against TPOT without, on one engine.

Batches of B identical-length requests decode the same number of tokens, once constrained by
a JSON schema (xgrammar's mask, rebuilt state and all) and once not; the two alternate over
the rounds and each keeps its best, so the ratio is measured side by side on this host.
TPOT = decode wall time / tokens per request (the prompt's prefill is excluded). Writes
bench/out/structured.json.

    pdd bench structured [--model default|tiny|small|PATH] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pdd.benchkit.progress import add_quiet_option
from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine, SamplingParams
from shared.model.presets import PRESETS

ITEMS = 30  # integers in the array: about 100 tokens of output with the byte tokenizer
SCHEMA = {
    "type": "object",
    "properties": {
        "numbers": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": ITEMS,
            "maxItems": ITEMS,
        }
    },
    "required": ["numbers"],
}
STRUCTURED = {"kind": "json", "spec": SCHEMA, "disable_any_whitespace": True}
PROMPT_TOKENS = 64


def decode_tpot(
    engine: LLMEngine, batch: int, tokens: int, structured: dict | None
) -> tuple[float, list[int]]:
    """Seconds per output token of one batch (first token excluded), and each output's length."""
    prompt = [(i * 7 + 3) % 250 for i in range(PROMPT_TOKENS)]
    for i in range(batch):
        params = SamplingParams(max_tokens=tokens, ignore_eos=structured is None, structured=structured)
        engine.add_request(f"r{i}", prompt, params)
    lengths = [0] * batch
    start = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                lengths[int(out.rid[1:])] += 1
        if start is None and all(lengths):
            start = time.perf_counter()  # every request has its first token: decoding from here
    assert start is not None
    return (time.perf_counter() - start) / max(1, max(lengths) - 1), lengths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pdd bench structured", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="default",
        help="default (the served default model), a preset (tiny | small | medium) or a checkpoint's path",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's own choice)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", default="bench/out/structured.json")
    add_quiet_option(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model in PRESETS:
        settings = ModelSettings(preset=args.model)
    else:
        settings = ModelSettings(path=None if args.model == "default" else args.model)
    engine = LLMEngine(settings, EngineSettings(kv_memory_mb=256))
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        _, lengths = decode_tpot(engine, batch, 300, STRUCTURED)  # warm-up; sets the length
        tokens = max(lengths)
        best = {"json_schema": float("inf"), "none": float("inf")}
        for _ in range(args.rounds):
            for name, structured in (("json_schema", STRUCTURED), ("none", None)):
                tpot, _ = decode_tpot(engine, batch, tokens, structured)
                best[name] = min(best[name], tpot)
        row = {
            "batch": batch,
            "output_tokens": tokens,
            "tpot_ms_json_schema": round(best["json_schema"] * 1e3, 3),
            "tpot_ms_none": round(best["none"] * 1e3, 3),
            "ratio": round(best["json_schema"] / best["none"], 3),
        }
        rows.append(row)
        print(json.dumps(row))
    result = {"model": engine.model_id, "vocab_size": engine.model_config.vocab_size, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
