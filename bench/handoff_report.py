"""`pdd bench handoff`'s report: per-condition statistics and ratios, targets, the table and
the figure."""

from __future__ import annotations

import math

import numpy as np

from bench.handoff_sides import KiB
from pdd.benchkit.report import pyplot


def stats(xs: list[float]) -> dict:
    a = np.asarray(xs, dtype=float)
    p50 = float(np.percentile(a, 50))
    p99 = float(np.percentile(a, 99))
    return {
        "n": len(a),
        "mean": float(a.mean()),
        "p50": p50,
        "p99": p99,
        "max": float(a.max()),
        "min": float(a.min()),
        "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
        "p99_over_p50": p99 / p50 if p50 > 0 else math.inf,
    }


def summarize_condition(kv: list[dict], tok: list[dict], cross_load: float) -> dict:
    out = {
        "cross_load": cross_load,
        "kv": {k: stats([r[k] for r in kv]) for k in ("total", "wire", "copy")},
        "token": {
            k: stats([r[k] for r in tok]) for k in ("total", "wire", "extend", "extend_cpu", "total_cpu")
        },
        "kv_payload_bytes": kv[0]["payload"],
        "kv_frame_bytes": kv[0]["frame_bytes"],
        "token_payload_bytes": tok[0]["payload"],
        "extend_correct": sum(r["correct"] for r in tok),
        "samples": {
            "kv": [r["total"] for r in kv],
            "token": [r["total"] for r in tok],
            "token_cpu": [r["total_cpu"] for r in tok],
        },
    }
    out["ratios"] = {
        "token_mean_over_kv_mean": out["token"]["total"]["mean"] / out["kv"]["total"]["mean"],
        "token_p99_over_kv_p99": out["token"]["total"]["p99"] / out["kv"]["total"]["p99"],
        "kv_std_over_token_std": out["kv"]["total"]["std"] / max(out["token"]["total"]["std"], 1e-9),
    }
    return out


def _fmt_ms(s: float) -> str:
    return f"{s * 1000:7.1f}"


def print_report(res: dict) -> None:
    c = res["config"]
    print(
        f"\nhandoff of {c['tokens']} generated tokens, preset {c['preset']}, context {c['context']} tokens; "
        f"WAN {c['delay_ms']:g} ms one way ±{c['jitter_ms']:g} ms jitter, {c['bandwidth_mbps']:g} Mbit/s"
    )
    p = res["payload"]
    print(
        f"payload: KV {p['kv_payload_bytes'] / KiB:.1f} KiB ({p['kv_blocks']} blocks of {p['block_size']} tokens; "
        f"{c['tokens']} tokens x {p['kv_bytes_per_token'] // KiB} KiB = {p['kv_useful_bytes'] / KiB:.1f} KiB), "
        f"{p['kv_wan_bytes'] / KiB:.1f} KiB on the WAN link  |  token IDs {p['token_payload_bytes']} B msgpack, "
        f"{p['token_wan_bytes']} B on the WAN (NATS framing)  ->  token/KV = 1/{p['kv_over_token']:.0f}"
    )
    hdr = (
        f"  {'path':24s} {'mean':>7s} {'p50':>7s} {'p99':>7s} {'max':>7s} {'std':>7s}  {'p99/p50':>7s}   (ms)"
    )
    for name, cond in res["conditions"].items():
        extra = f", cross traffic {cond['cross_load']:.0%} of the link" if cond["cross_load"] else ""
        print(f"\n[{name}{extra}]  n={cond['kv']['total']['n']}")
        print(hdr)
        rows = [
            ("KV over WAN + copy", cond["kv"]["total"]),
            ("  of which WAN", cond["kv"]["wire"]),
            ("  of which pool copy", cond["kv"]["copy"]),
            ("token IDs + extend", cond["token"]["total"]),
            ("  of which NATS/WAN", cond["token"]["wire"]),
            ("  of which extend pass", cond["token"]["extend"]),
            ("  extend pass, CPU time", cond["token"]["extend_cpu"]),
            ("token IDs, extend at CPU", cond["token"]["total_cpu"]),
        ]
        for label, s in rows:
            print(
                f"  {label:24s} {_fmt_ms(s['mean'])} {_fmt_ms(s['p50'])} {_fmt_ms(s['p99'])} {_fmt_ms(s['max'])} "
                f"{_fmt_ms(s['std'])}  {s['p99_over_p50']:7.2f}"
            )
        r = cond["ratios"]
        print(
            f"  token/KV mean x{r['token_mean_over_kv_mean']:.2f}, token/KV p99 x{r['token_p99_over_kv_p99']:.2f}, "
            f"KV std / token std x{r['kv_std_over_token_std']:.1f}; extend sampled the reference token "
            f"{cond['extend_correct']}/{cond['token']['total']['n']}"
        )


def figure(res: dict):
    plt = pyplot()
    conds = res["conditions"]
    fig, axes = plt.subplots(1, len(conds), figsize=(5.5 * len(conds), 3.8), squeeze=False)
    for ax, (name, cond) in zip(axes[0], conds.items(), strict=True):
        for key, label, style in (
            ("kv", "KV over WAN + pool copy", "-"),
            ("token", "token IDs + extend pass", "-"),
            ("token_cpu", "token IDs + extend pass at its CPU time", ":"),
        ):
            xs = np.sort(np.asarray(cond["samples"][key]) * 1000)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), style, label=label)
        ax.set_xlabel("handoff latency (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(name + (f" (+{cond['cross_load']:.0%} cross traffic)" if cond["cross_load"] else ""))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    return fig


def targets_of(payload: dict, conds: dict) -> list[dict]:
    targets = [
        {
            "what": "token-ID payload <= 1/100 of the KV payload (bytes on the WAN)",
            "value": f"1/{payload['kv_over_token']:.0f}",
            "met": payload["kv_over_token"] >= 100,
        }
    ]
    for name, c in conds.items():
        tr, kr = c["token"]["total"]["p99_over_p50"], c["kv"]["total"]["p99_over_p50"]
        targets.append({"what": f"{name}: token-ID p99/p50 <= 1.2", "value": f"{tr:.2f}", "met": tr <= 1.2})
        tc = c["token"]["total_cpu"]["p99_over_p50"]
        targets.append(
            {
                "what": f"{name}: token-ID p99/p50 <= 1.2, extend pass at its CPU time (host noise out)",
                "value": f"{tc:.2f}",
                "met": tc <= 1.2,
            }
        )
        targets.append({"what": f"{name}: KV p99/p50 > 1.2", "value": f"{kr:.2f}", "met": kr > 1.2})
    return targets
