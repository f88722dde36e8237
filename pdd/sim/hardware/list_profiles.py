"""`pdd sim profiles`: the hardware profiles with their key figures and prices, the model shapes,
and what one profile makes of one model (--model)."""

from __future__ import annotations

import argparse

from pdd.sim.hardware.profiles import chip, load_profile, model_names, model_spec, profile_names
from pdd.sim.hardware.step_cost import chunk_load

PROBE_CONTEXT = 1024  # the decode step and prefill chunk shown per profile with --model


def profile_line(name: str) -> str:
    p = load_profile(name)
    if p["kind"] == "roofline":
        figures = (
            f"{p['peak_bf16_flops'] / 1e12:7.0f} TFLOP/s {p['hbm_bandwidth_bytes_per_s'] / 1e12:5.2f} TB/s "
            f"{p['memory_bytes'] / 1e9:5.0f} GB  eff {p['compute_efficiency']:.2f}/{p['memory_efficiency']:.2f} "
            f"overhead {p['overhead_s'] * 1e3:.1f} ms"
        )
    else:
        m, fit = p["model"], p["fit"]
        figures = (
            f"fitted to {m['name']} {m['dtype']} on {m['device']} ({m['threads']} threads): overhead "
            f"{p['step']['overhead_s'] * 1e3:.2f} ms, median |error| {fit['median_abs_rel_error']:.1%}"
        )
    return f"{name:<18}{p['kind']:<11}${p['price_per_hour']:>6.2f}/h  {figures}"


def model_line(profile: str, model_name: str, tp: int = 1) -> str:
    try:
        c = chip(profile, model_spec(model_name), tp)
    except ValueError as e:
        return f"{profile:<18}-- {e}"
    spec = model_spec(model_name)
    decode_ms = c.step.decode_step_s(1, PROBE_CONTEXT) * 1e3
    prefill_ms = c.step.step_s(chunk_load(PROBE_CONTEXT, 0)) * 1e3
    return (
        f"{profile:<18}KV {c.kv_capacity_bytes / 1e9:7.1f} GB = {c.kv_capacity_bytes // spec.kv_bytes_per_token:>9} tokens"
        f"  decode (1 seq, {PROBE_CONTEXT} ctx) {decode_ms:8.2f} ms  prefill {PROBE_CONTEXT} tokens {prefill_ms:8.1f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdd sim profiles", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        default=None,
        help=f"also show what each profile makes of this model: {', '.join(model_names())}",
    )
    ap.add_argument(
        "--tp", type=int, default=1, help="chips per instance (tensor parallel; roofline profiles)"
    )
    args = ap.parse_args(argv)
    print("hardware profiles (pdd/sim/hardware/profiles/, $PDD_SIM_PROFILES):")
    for name in profile_names():
        print("  " + profile_line(name))
    print("models: " + ", ".join(model_names()))
    if args.model:
        spec = model_spec(args.model)
        print(
            f"\n{args.model}: {spec.params / 1e9:.2f} B params, {spec.weight_bytes / 1e9:.2f} GB of weights, "
            f"{spec.kv_bytes_per_token} KV bytes/token"
        )
        for name in profile_names():
            print("  " + model_line(name, args.model, args.tp))
    return 0
