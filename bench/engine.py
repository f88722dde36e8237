"""Engine benchmark: our paged, continuously batched engine vs Hugging Face `generate`.

Same weights on both sides (the preset is saved as a Hugging Face Llama directory and
loaded with transformers). Three parts, all in one run:
  1. KV accounting: bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes, and
     the pool holds nothing else (blocks used = sum of ceil(tokens / block_size)).
  2. Mixed workload: N requests of mixed prompt/output lengths, greedy, EOS ignored.
     Ours: all submitted at once (continuous batching). HF: padded batches (left padding,
     every row runs to the batch's longest output). Throughput counts useful tokens only
     (prompt + requested output); greedy outputs are compared token by token.
  3. Prefill and decode tokens/s at batch 1, 8, 32 for both.
  4. Floors, measured on this host: one decode step against what it must at least read.
     Weights floor: a matvec over every weight matrix (all threads, and one thread);
     KV floor: one read of the KV the step attends over. Decode steps at batch 1 and at
     16 x 3072 context (and 8 x 1536), on the reference attention backend (gather + SDPA)
     and the paged one (the C++ kernel reading blocks in place), side by side.
Parts 2 and 4 run on both attention backends, alternating, each keeping its best.
Writes bench/out/engine.json and engine.png.

    python -m bench.engine [--quick]
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.engine_runs import (
    hf_model,
    kv_accounting,
    make_engine,
    run_hf_mixed,
    run_ours_mixed,
    sweep_hf,
    sweep_ours,
    warm_up,
    workload,
)
from bench.floors import floor_rows
from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from shared.engine import LLMEngine
from shared.model.attention import AttentionBackend, attention_backend


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdd bench engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter prompts/outputs and fewer decode steps")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=32, help="rows per padded HF generate batch")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes of the prefill/decode sweep")
    ap.add_argument("--repeat", type=int, default=2, help="alternate ours/HF this many times, keep the best")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--linear-backend",
        default="auto",
        choices=["auto", "panel", "packed", "torch"],
        help="the engine's linear layers",
    )
    ap.add_argument(
        "--small-ops",
        default="auto",
        choices=["auto", "fused", "torch"],
        help="the engine's RMSNorm and RoPE: fused C++ calls or tensor ops",
    )
    ap.add_argument(
        "--floor-shapes",
        default="1x128,8x1536,16x3072",
        help="decode steps timed against the floors: SEQSxCONTEXT,...",
    )
    ap.add_argument("--floors-only", action="store_true", help="only part 4 (no HF model, no mixed workload)")
    ap.add_argument("--out", default="bench/out/engine.json")
    add_quiet_option(ap)
    return ap.parse_args(argv)


def mixed_workload(
    engine: LLMEngine,
    hf,
    args,
    reqs: list[tuple[list[int], int]],
    prompt_range: tuple,
    output_range: tuple,
    backends: dict[str, AttentionBackend],
) -> dict:
    # The machine may be shared: alternate the sides and keep each side's best time. "ours" is
    # the engine's own backend; every backend in `backends` runs the same requests too.
    t_hf = float("inf")
    by_backend = {name: float("inf") for name in backends}
    kept = engine.runner.backend
    ours: dict = {}
    with progress("mixed workload, ours and HF", total=(len(backends) + 1) * max(1, args.repeat)) as advance:
        for _ in range(max(1, args.repeat)):
            for name, backend in backends.items():
                engine.runner.backend = backend
                t, out = run_ours_mixed(engine, reqs, args.device)
                by_backend[name] = min(by_backend[name], t)
                if name == kept.name:  # the engine's own backend (another instance of it)
                    ours = out
                advance()
            engine.runner.backend = kept
            t, theirs = run_hf_mixed(hf, reqs, args.hf_batch, args.device)
            t_hf = min(t_hf, t)
            advance()
    t_ours = by_backend[kept.name]
    useful = sum(len(p) + n for p, n in reqs)
    result = {
        "requests": len(reqs),
        "prompt_range": prompt_range,
        "output_range": output_range,
        "repeat": args.repeat,
        "useful_tokens": useful,
        "hf_batch": args.hf_batch,
        "backend": kept.name,
        "ours_s": t_ours,
        "hf_s": t_hf,
        "by_backend_s": by_backend,
        "ours_tokens_per_s": useful / t_ours,
        "hf_tokens_per_s": useful / t_hf,
        "ratio": t_hf / t_ours,
        "identical_outputs": sum(ours[k] == theirs[k] for k in ours),
        "identical_tokens": sum(a == b for k in ours for a, b in zip(ours[k], theirs[k], strict=True)),
        "output_tokens": sum(n for _, n in reqs),
    }
    if {"reference", "paged"} <= by_backend.keys():
        result["paged_speedup"] = by_backend["reference"] / by_backend["paged"]
    return result


def batch_sweep(engine: LLMEngine, hf, args, batches: list[int], prompt_len: int, steps: int) -> list[dict]:
    """Prefill and decode tokens/s of both at each batch size (best of --repeat)."""
    sweep = []
    for b in batches:
        op = od = hp = hd = 0.0
        with progress(f"batch {b}, ours and HF", total=2 * max(1, args.repeat)) as advance:
            for _ in range(max(1, args.repeat)):
                p, d = sweep_ours(engine, b, prompt_len, steps, args.device)
                op, od = max(op, p), max(od, d)
                advance()
                p, d = sweep_hf(hf, b, prompt_len, steps, args.device)
                hp, hd = max(hp, p), max(hd, d)
                advance()
        sweep.append(
            {
                "batch": b,
                "ours_prefill_tps": op,
                "hf_prefill_tps": hp,
                "prefill_ratio": op / hp,
                "ours_decode_tps": od,
                "hf_decode_tps": hd,
                "decode_ratio": od / hd,
            }
        )
    return sweep


def _backends(device: str) -> dict[str, AttentionBackend]:
    """The reference and, where it runs, the paged backend (the engine's default there)."""
    found = {"reference": attention_backend("reference", device)}
    paged = attention_backend("auto", device)
    if paged.name == "paged":
        found["paged"] = paged
    return found


def _shapes(spec: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (s.split("x") for s in spec.split(","))]


def run(args) -> dict:
    reqs, prompt_range, output_range = workload(args)
    sweep_prompt, sweep_steps = (64, 16) if args.quick else (128, 32)
    batches = [int(b) for b in args.batches.split(",")]
    shapes = _shapes(args.floor_shapes)
    useful = sum(len(p) + n for p, n in reqs)
    kv_tokens = max(useful, max(batches) * (sweep_prompt + sweep_steps + 1)) + 16 * len(reqs)
    kv_tokens = max(kv_tokens, max(n * (c + 16) for n, c in shapes))
    engine = make_engine(args, kv_tokens, max_batched=2048)
    backends = _backends(args.device)
    print(
        f"model {engine.model_id} ({args.dtype}, {args.device}), {torch.get_num_threads()} CPU threads "
        f"of {os.cpu_count()} cores, attention backend {engine.runner.backend.name}, "
        f"linear layers {engine.linear_backend}, small ops {engine.small_ops}",
        flush=True,
    )
    result = {
        "model": engine.model_id,
        "dtype": args.dtype,
        "device": args.device,
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "backend": engine.runner.backend.name,
        "linear_backend": engine.linear_backend,
        "small_ops": engine.small_ops,
    }
    with progress("floors and decode steps per attention backend"):
        result["floors"] = floor_rows(engine, backends, shapes, max(2, args.repeat))
    result["targets"] = _targets(result)
    if args.floors_only:
        return result
    result["kv"] = kv_accounting(engine)
    with progress("loading the HF model, warming up"):
        hf = hf_model(engine, args.device)
        warm_up(engine, hf, args.device)
    result["mixed"] = mixed_workload(engine, hf, args, reqs, prompt_range, output_range, backends)
    result["sweep_prompt"], result["sweep_steps"] = sweep_prompt, sweep_steps
    result["sweep"] = batch_sweep(engine, hf, args, batches, sweep_prompt, sweep_steps)
    if "paged_speedup" in result["mixed"]:
        result["targets"].append(
            {
                "what": "mixed workload, paged attention faster than reference",
                "value": f"{result['mixed']['paged_speedup']:.2f}x",
                "met": result["mixed"]["paged_speedup"] > 1,
            }
        )
    return result


def _targets(result: dict) -> list[dict]:
    """Batch-1 decode within 1.5x of the weights floor, 16 x 3072 within 2x of weights + KV."""
    name = result["backend"]
    targets = []
    for r in result["floors"]["rows"]:
        bound = 1.5 if r["seqs"] == 1 else 2.0 if (r["seqs"], r["context"]) == (16, 3072) else None
        x = r["x_floor"][name]
        targets.append(
            {
                "what": f"decode step {r['seqs']} x {r['context']} ({name}) vs its floor"
                + (f", at most {bound}x" if bound else ""),
                "value": f"{x:.2f}x",
                "met": None if bound is None else x <= bound,
            }
        )
    return targets


def _print_floors(f: dict) -> None:
    print(
        f"\nfloors on this host ({f['threads']} threads): weights {f['weight_bytes'] / 1e6:.0f} MB, one read of them "
        f"{f['weights_floor_ms']:.1f} ms ({f['weights_gb_per_s']:.1f} GB/s), one thread {f['weights_floor_1thread_ms']:.1f} ms"
    )
    names = list(f["rows"][0]["step_ms"]) if f["rows"] else []
    head = "".join(f"{n + ' ms':>14}{'x floor':>8}" for n in names)
    print(f"  {'decode step':>12} {'KV MB':>7} {'floor ms':>9} (weights + KV){head} {'paged speedup':>14}")
    for r in f["rows"]:
        cells = "".join(f"{r['step_ms'][n]:14.1f}{r['x_floor'][n]:8.2f}" for n in names)
        speed = f"{r['paged_speedup']:14.2f}" if "paged_speedup" in r else ""
        print(
            f"  {str(r['seqs']) + ' x ' + str(r['context']):>12} {r['kv_bytes'] / 1e6:7.0f} {r['floor_ms']:9.1f} "
            f"({r['weights_floor_ms']:.1f} + {r['kv_floor_ms']:.1f}){cells} {speed}"
        )


def _print(result: dict) -> None:
    _print_floors(result["floors"])
    if "mixed" not in result:
        return
    kv, m = result["kv"], result["mixed"]
    print(
        f"KV bytes/token {kv['kv_bytes_per_token']} (expected {kv['expected_2_x_layers_x_kv_heads_x_head_dim_x_dtype_bytes']}); "
        f"pool {kv['pool_bytes'] / 2**20:.1f} MiB, overhead {kv['pool_overhead_bytes']} B; "
        f"8 prompts use {kv['blocks_used_for_8_prompts']} blocks = {kv['blocks_by_rounding']} by rounding: "
        f"{'OK' if kv['ok'] else 'MISMATCH'}"
    )
    print(
        f"\nmixed workload: {m['requests']} requests, prompts {m['prompt_range']}, outputs {m['output_range']}, "
        f"{m['useful_tokens']} useful tokens"
    )
    print(f"  ours  {m['ours_s']:7.2f} s  {m['ours_tokens_per_s']:8.0f} tok/s   ({m['backend']} attention)")
    for name, t in m["by_backend_s"].items():
        print(f"    {name:<9} {t:7.2f} s")
    if "paged_speedup" in m:
        print(f"    paged vs reference: {m['paged_speedup']:.2f}x")
    print(
        f"  HF    {m['hf_s']:7.2f} s  {m['hf_tokens_per_s']:8.0f} tok/s   (padded batches of {m['hf_batch']})"
    )
    print(
        f"  ratio {m['ratio']:.2f}x   greedy outputs identical: {m['identical_outputs']}/{m['requests']} requests, "
        f"{m['identical_tokens']}/{m['output_tokens']} tokens"
    )
    print(f"\nbatch sweep: prompt {result['sweep_prompt']} tokens, {result['sweep_steps']} decode steps")
    print(
        f"  {'batch':>5} {'prefill ours':>13} {'prefill HF':>11} {'ratio':>6} {'decode ours':>12} {'decode HF':>10} {'ratio':>6}"
    )
    for s in result["sweep"]:
        print(
            f"  {s['batch']:>5} {s['ours_prefill_tps']:13.0f} {s['hf_prefill_tps']:11.0f} {s['prefill_ratio']:6.2f} "
            f"{s['ours_decode_tps']:12.0f} {s['hf_decode_tps']:10.0f} {s['decode_ratio']:6.2f}"
        )


def _figure(result: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    m = result["mixed"]
    axes[0].bar(["ours", "HF generate"], [m["ours_tokens_per_s"], m["hf_tokens_per_s"]], color=["C0", "C1"])
    axes[0].set_title(f"mixed workload ({m['ratio']:.2f}x)")
    axes[0].set_ylabel("tokens/s")
    for ax, kind in zip(axes[1:], ("prefill", "decode"), strict=True):
        bs = [str(s["batch"]) for s in result["sweep"]]
        x = range(len(bs))
        ax.bar([i - 0.2 for i in x], [s[f"ours_{kind}_tps"] for s in result["sweep"]], 0.4, label="ours")
        ax.bar([i + 0.2 for i in x], [s[f"hf_{kind}_tps"] for s in result["sweep"]], 0.4, label="HF")
        ax.set_xticks(list(x), bs)
        ax.set_xlabel("batch")
        ax.set_title(f"{kind} tokens/s")
        ax.legend()
    fig.suptitle(f"{result['model']} {result['dtype']} on {result['device']}")
    return fig


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    result = run(args)
    save_report(result, args.out, table=_print, figures=None if args.floors_only else _figure)
    return 0 if result.get("kv", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
