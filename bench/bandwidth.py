"""WAN bytes per request vs average prefix hit rate: prefix-aware transfer vs full transfer.

Measured through the real system (`pdd up`, the default model unless --model-preset names a
preset): every request's `pdd.wan_bytes`
is what MD received over the bulk channel. For each target average hit rate, a fresh
"document" of --prompt-tokens is put into MD's cache by one seeding request (not counted);
then --requests requests reuse a prefix of it and add fresh tokens, with per-request hit
rates drawn around the target (skewed like agentic traffic: most near the top, a few far
below; the mean is the target). Full transfer (what a prefix-unaware PD system sends) is
measured the same way with requests MD holds nothing of (hit 0, same length). The model's
expectation is (uncached full blocks) x KV bytes per token.

    python -m bench.bandwidth [--quick] [--hits 0,0.25,0.5,0.75,0.9,0.95,0.99] [--requests 6]

Then the WAN KV codecs (PDD_PREFILL_WAN_KV_CODEC) side by side: bytes cut and quality against
the exact path (mean KL of next-token distributions, greedy token agreement) on the default
(trained) model, the tiny and small presets and any --checkpoint, measured on the model directly
(bench/codec_quality.py).
--codec-only runs just that part, in seconds, and updates the "codec" key of an existing JSON.

Writes bench/out/bandwidth.json and bench/out/bandwidth.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench import codec_quality
from bench.client import random_tokens, service_env, set_wan, stream_completion, wan_counters
from pdd.benchkit.progress import Advance, add_quiet_option, progress
from pdd.benchkit.report import pyplot, save_report
from pdd.system import RunningSystem, start_system
from shared.config import ModelSettings
from shared.model.describe import describe_model

BLOCK = 16
DEFAULT_MODEL = "default"  # --codec-models: the embedded default model


def hit_mix(rng: random.Random, mean: float, n: int, spread: float) -> list[float]:
    """n hit rates in [0, 0.99] whose mean is `mean`: most requests just above it, a few far
    below (a skewed mix, as in agentic traffic). spread=0: every request exactly at the mean."""
    if spread <= 0 or mean <= 0 or mean >= 0.99:
        return [min(mean, 0.99)] * n
    n_low = max(1, round(n * spread))
    n_high = n - n_low
    high = min(0.99, mean + (1 - mean) * 0.7)  # the majority sits above the mean
    low_mean = (mean * n - high * n_high) / n_low
    if low_mean < 0:  # cannot balance: shrink the high group towards the mean
        high = mean * n / n_high
        low_mean = 0.0
    lows = [
        min(max(low_mean + rng.uniform(-1, 1) * min(low_mean, 0.99 - low_mean), 0.0), 0.99)
        for _ in range(n_low)
    ]
    shift = low_mean - statistics.fmean(lows)  # keep the exact mean
    lows = [min(max(x + shift, 0.0), 0.99) for x in lows]
    hits = [high] * n_high + lows
    rng.shuffle(hits)
    return hits


def _full_transfer(client: httpx.Client, args: argparse.Namespace, L: int, advance: Advance) -> list[int]:
    """WAN bytes of requests MD holds nothing of: what a prefix-unaware PD system sends."""
    full = []
    for i in range(args.full_requests):
        t = stream_completion(
            client, random_tokens(random.Random(f"full-{i}"), L), args.max_tokens, pipeline="p-md"
        )
        if t.ok:
            full.append(t.pdd.get("wan_bytes", 0))
        advance()
    return full


def _hit_point(
    system: RunningSystem,
    client: httpx.Client,
    args: argparse.Namespace,
    rng: random.Random,
    h: float,
    L: int,
    full_bytes: float,
    advance: Advance,
) -> dict:
    """Requests whose hit rates average h, each reusing a prefix of one document MD holds."""
    doc = random_tokens(random.Random(f"doc-{h}-{args.seed}"), L)
    seed = stream_completion(client, doc, 2, pipeline="p-md")  # MD now holds doc's blocks
    if not seed.ok:
        raise RuntimeError(f"seeding request failed: {seed.error}")
    time.sleep(0.3)  # MD's KV events reach the router (its hit-rate view)
    before = wan_counters(system)["bulk"]["bytes_up"]
    rows = []
    for j, target in enumerate(hit_mix(rng, h, args.requests, args.spread)):
        k = int(target * L) // BLOCK * BLOCK
        prompt = doc[:k] + random_tokens(random.Random(f"q-{h}-{j}-{args.seed}"), L - k)
        t = stream_completion(client, prompt, args.max_tokens, pipeline="p-md")
        rows.append(
            {
                "target": target,
                "cached_tokens": k,
                "ok": t.ok,
                "error": t.error,
                "hit": t.pdd.get("prefix_hit_rate"),
                "wan_bytes": t.pdd.get("wan_bytes", 0),
                "model_bytes": (L - k) // BLOCK * BLOCK * args.kv_bytes_per_token,
            }
        )
        advance()
    time.sleep(0.2)
    link = (wan_counters(system)["bulk"]["bytes_up"] - before) / len(rows)
    ok = [r for r in rows if r["ok"]]
    aware = statistics.fmean(r["wan_bytes"] for r in ok)
    model = statistics.fmean(r["model_bytes"] for r in ok)
    return {
        "target_mean_hit": h,
        "mean_hit": statistics.fmean(r["hit"] for r in ok),
        "requests": len(ok),
        "aware_bytes": aware,
        "full_bytes": full_bytes,
        "link_bytes": link,
        "model_aware_bytes": model,
        "model_full_bytes": L * args.kv_bytes_per_token,
        "full_over_aware": full_bytes / aware if aware else float("inf"),
        "aware_over_model": aware / model if model else (1.0 if aware == 0 else float("inf")),
        "rows": rows,
    }


def _targets(points: list[dict]) -> list[dict]:
    if not points:
        return []
    at90 = min(points, key=lambda p: abs(p["target_mean_hit"] - 0.9))
    ratio = at90["aware_bytes"] / at90["full_bytes"]
    return [
        {
            "what": f"WAN bytes at {at90['mean_hit']:.0%} average hit <= 1/8 of full transfer",
            "value": f"1/{1 / ratio:.1f}" if ratio else "0",
            "met": ratio <= 1 / 8,
        }
    ]


def run(args: argparse.Namespace) -> dict:
    env = service_env(args.torch_threads, md_kv_mb=512, prefill_kv_mb=512, relay_kv_mb=128)
    workdir = Path(tempfile.mkdtemp(prefix="pdd-bench-bandwidth-"))
    model = ModelSettings(preset=args.model_preset or None)
    args.kv_bytes_per_token = describe_model(model).kv_bytes_per_token  # float32, as served on the CPU
    with progress("starting pdd up"):
        system = start_system(
            workdir,
            env,
            delay_ms=0,
            jitter_ms=0,
            bandwidth_mbps=1000,
            model_preset=args.model_preset or None,
            timeout_s=300,
        )
    # Bytes do not depend on the link's speed: no cap, so the run is quick.
    set_wan(system, delay_ms=0, jitter_ms=0, bandwidth_mbps=None)
    L = args.prompt_tokens // BLOCK * BLOCK
    rng = random.Random(args.seed)
    points = []
    n_requests = args.full_requests + len(args.hits) * args.requests
    try:
        with (
            httpx.Client(base_url=system.router_url) as client,
            progress("bandwidth", total=n_requests) as advance,
        ):
            stream_completion(client, random_tokens(random.Random(99), L), 2, pipeline="p-md")  # warm up
            full = _full_transfer(client, args, L, advance)
            full_bytes = statistics.fmean(full)
            for h in args.hits:
                point = _hit_point(system, client, args, rng, h, L, full_bytes, advance)
                points.append(point)
                print(
                    f"  mean hit {point['mean_hit']:6.1%}: {point['aware_bytes'] / 2**20:7.2f} MiB/request (model "
                    f"{point['model_aware_bytes'] / 2**20:.2f}), full {full_bytes / 2**20:.2f} MiB -> "
                    f"x{point['full_over_aware']:.1f} less",
                    flush=True,
                )
    finally:
        system.stop()
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "prompt_tokens": L,
        "model": args.model_preset or "default",
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "full_bytes_measured": full,
        "points": points,
        "targets": _targets(points),
    }


def run_codecs(args: argparse.Namespace) -> dict:
    models = [
        ModelSettings(preset=None if m == DEFAULT_MODEL else m, dtype=args.codec_dtype)
        for m in args.codec_models
    ]
    models += [ModelSettings(path=str(c), dtype=args.checkpoint_dtype) for c in args.checkpoint]
    results = []
    with progress("codec quality", total=len(models)) as advance:
        for m in models:
            results.append(
                codec_quality.measure(
                    m,
                    prompts=args.codec_prompts,
                    prompt_tokens=args.codec_prompt_tokens,
                    new_tokens=args.codec_new_tokens,
                    seed=args.seed,
                )
            )
            advance()
    return {"about": codec_quality.__doc__.split("\n\n")[0], "models": results}


def _codec_targets(codec: dict) -> list[dict]:
    """int8: about a byte a value (>= 3.5x fewer than fp32, >= 1.9x than 16-bit KV), its mean KL
    under 1e-3 nat or within 2x of the noise control's (KV moved by bf16's own rounding), and
    >= 95% of teacher-forced top-1 tokens the exact path's."""
    out = []
    for r in codec.get("models", []):
        f, noise = r["codecs"].get("int8"), r["codecs"].get(codec_quality.NOISE)
        if f is None:
            continue
        want = 3.5 if r["dtype"] == "float32" else 1.9
        kl_bound = max(1e-3, 2 * noise["mean_kl"]) if noise else 1e-3
        out.append(
            {
                "what": f"int8 WAN KV on {r['model']} ({r['dtype']}): >= {want}x fewer bytes, "
                f"mean KL <= {kl_bound:.1e}, top-1 >= 95%",
                "value": f"{f['bytes_ratio']:.2f}x, KL {f['mean_kl']:.1e}, top-1 {f['top1_agreement']:.0%}"
                f" (greedy {f['greedy_agreement']:.0%})",
                "met": f["bytes_ratio"] >= want and f["mean_kl"] <= kl_bound and f["top1_agreement"] >= 0.95,
            }
        )
    return out


def _print(res: dict) -> None:
    if "codec" in res:
        codec_quality.print_table(res["codec"]["models"])
    if "points" not in res:
        return
    c = res["config"]
    print(
        f"\nWAN bytes per request, prompt {res['prompt_tokens']} tokens ({res['kv_bytes_per_token'] // 1024} KiB "
        f"of KV per token), {c['requests']} requests per point, hit spread {c['spread']:g}; prefix-aware = "
        f"pdd.wan_bytes (KV MD received), on the link = the WAN emulator's bulk-link byte counter"
    )
    print(
        f"  {'mean hit':>8s} {'prefix-aware':>13s} {'on the link':>11s} {'model':>10s} {'full':>10s} "
        f"{'full/aware':>10s} {'aware/model':>11s}"
    )
    for p in res["points"]:
        print(
            f"  {p['mean_hit']:8.1%} {p['aware_bytes'] / 2**20:9.2f} MiB {p['link_bytes'] / 2**20:7.2f} MiB "
            f"{p['model_aware_bytes'] / 2**20:6.2f} MiB "
            f"{p['full_bytes'] / 2**20:6.2f} MiB {p['full_over_aware']:9.1f}x {p['aware_over_model']:10.3f}"
        )


def _figure(res: dict):
    plt = pyplot()
    pts = res["points"]
    xs = [p["mean_hit"] * 100 for p in pts]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(xs, [p["full_bytes"] / 2**20 for p in pts], "s--", label="full transfer (measured, hit 0)")
    ax.plot(xs, [p["aware_bytes"] / 2**20 for p in pts], "o-", label="prefix-aware (measured)")
    ax.plot(
        xs,
        [p["model_aware_bytes"] / 2**20 for p in pts],
        ":",
        color="k",
        label="model: uncached blocks x KV/token",
    )
    ax.set_yscale("log")
    ax.set_xlabel("average prefix hit rate at MD (%)")
    ax.set_ylabel("WAN bytes per request (MiB)")
    ax.set_title(f"KV over the WAN per request ({res['prompt_tokens']}-token prompts)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdd bench bandwidth",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="3 requests per point, shorter prompts (codecs too)")
    p.add_argument("--hits", default="0,0.25,0.5,0.75,0.9,0.95,0.99", help="target average hit rates")
    p.add_argument("--requests", type=int, default=6, help="requests per hit-rate point")
    p.add_argument("--full-requests", type=int, default=3, help="cold requests measuring the full transfer")
    p.add_argument(
        "--spread",
        type=float,
        default=0.25,
        help="share of requests far below the mean (0 = all exactly at the mean)",
    )
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/bandwidth.json")
    p.add_argument("--codec-only", action="store_true", help="only the WAN KV codec comparison")
    p.add_argument("--no-codec", action="store_true", help="skip the WAN KV codec comparison")
    p.add_argument(
        "--model-preset",
        default="",
        help="the system's model: a preset (tiny, small); default: the default model",
    )
    p.add_argument(
        "--codec-models",
        default=f"{DEFAULT_MODEL},tiny,small",
        help=f"models the codecs are measured on: {DEFAULT_MODEL} (the embedded trained model) or presets",
    )
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="a Hugging Face directory to measure the codecs on too (repeatable)",
    )
    p.add_argument("--checkpoint-dtype", default="bfloat16", help="engine dtype of --checkpoint")
    p.add_argument(
        "--codec-dtype", default="float32", help="engine dtype of the presets (float32 | bfloat16)"
    )
    p.add_argument("--codec-prompts", type=int, default=4)
    p.add_argument("--codec-prompt-tokens", type=int, default=512)
    p.add_argument("--codec-new-tokens", type=int, default=32)
    add_quiet_option(p)
    args = p.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 4)
        args.full_requests = min(args.full_requests, 2)
        args.prompt_tokens = min(args.prompt_tokens, 1024)
        args.codec_prompts = min(args.codec_prompts, 2)
        args.codec_prompt_tokens = min(args.codec_prompt_tokens, 256)
    args.hits = [float(x) for x in str(args.hits).split(",")] if isinstance(args.hits, str) else args.hits
    args.codec_models = [x for x in str(args.codec_models).split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    t0 = time.monotonic()
    if args.codec_only:  # the system's figures of an earlier run stay
        out = Path(args.out)
        res = json.loads(out.read_text()) if out.exists() else {}
    else:
        res = run(args)
    if not args.no_codec:
        res["codec"] = run_codecs(args)
        res["targets"] = [t for t in res.get("targets", []) if not t["what"].startswith("int8 WAN KV")]
        res["targets"] += _codec_targets(res["codec"])
    res["wall_s"] = time.monotonic() - t0
    save_report(res, args.out, table=_print, figures=_figure if "points" in res else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
