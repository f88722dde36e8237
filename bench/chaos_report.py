"""`pdd chaos`'s report: the targets judged on the faults' rows, the tables (per fault, and fault
x pipeline) and the figure."""

from __future__ import annotations

import math

from bench.chaos_client import PIPELINES
from bench.chaos_faults import NO_FAILURE_EXPECTED
from pdd.benchkit.report import pyplot


def targets_of(rows: dict[str, dict]) -> list[dict]:
    total = lambda key: sum(r.get(key, 0) for r in rows.values())  # noqa: E731
    settled = [r.get("left_after_settling") or {} for r in rows.values()]
    held = sum(s.get("held", 0) + s.get("blocks", 0) for s in settled)
    missing = sum(s.get("routers_down", 0) + s.get("instances_missing", 0) for s in settled)
    quiet = sum(rows[f]["failed_clear"] + rows[f]["hung"] for f in NO_FAILURE_EXPECTED if f in rows)
    gaps = [r["migrated_max_gap_p99_s"] for r in rows.values() if r.get("migrated")]
    gaps = [g for g in gaps if not math.isnan(g)]  # (NaN: each moved stream of that fault was resumed)
    shares = {f: r["affected_completed_share"] for f, r in rows.items() if r.get("affected")}
    worst = min(shares, key=shares.get) if shares else None
    term, crash = rows.get("restart-router"), rows.get("kill-router")
    broke = crash["broken_connections"] if crash else 0
    resumed = crash["resumed_equal"] / broke if broke else None
    return [
        {"what": "hung requests (0)", "value": total("hung"), "met": total("hung") == 0},
        {
            "what": "streams with tokens missing or repeated (0)",
            "value": total("missing_or_repeated"),
            "met": total("missing_or_repeated") == 0,
        },
        {
            "what": "completed outputs unlike the undisturbed run (0)",
            "value": total("mismatched"),
            "met": total("mismatched") == 0,
        },
        {"what": "requests or KV blocks held after settling (0)", "value": held, "met": held == 0},
        {
            "what": "routers down or instances missing after settling (0)",
            "value": missing,
            "met": missing == 0,
        },
        {
            "what": "affected requests completed, a moved or resumed one included, worst fault (>= 95%)",
            "value": {"fault": worst, "share": shares[worst]} if worst else None,
            "met": (shares[worst] >= 0.95) if worst else None,
        },
        {
            "what": "p99 longest gap of a migrated stream, worst fault (<= 2 s)",
            "value": max(gaps) if gaps else None,
            "met": (max(gaps) <= 2.0) if gaps else None,
        },
        {
            "what": "router SIGTERM (restart-router): broken streams (0)",
            "value": term["broken_connections"] if term else None,
            "met": (term["broken_connections"] == 0) if term else None,
        },
        {
            "what": "router SIGKILL (kill-router): broken streams resumed, tokens equal (>= 95%)",
            "value": {"broken": broke, "resumed": crash["resumed_equal"]} if crash else None,
            "met": (resumed is not None and resumed >= 0.95) if crash and broke else None,
        },
        {
            "what": "failed requests under NATS restart / gateway or bulk cut / MD pause (0)",
            "value": quiet,
            "met": quiet == 0,
        },
    ]


def _cell(c: dict) -> str:
    return f"{c['completed']:>3} ok {c['migrated']:>2}mv {c['resumed']:>2}rs {c['failed_clear']:>2}F {c['hung']}H"


def _print_matrix(result: dict) -> None:
    """fault x pipeline -> completed (moved / resumed) / failed / hung."""
    n = result.get("instances") or {}
    print(
        f"\nfailure matrix at prefill {n.get('prefill', 1)}, relay {n.get('relay', 1)}, md {n.get('md', 1)}, "
        f"routers {n.get('routers', 1)} (mv: migrated, rs: resumed, F: failed, H: hung)"
    )
    print(f"{'fault':16}" + "".join(f" {p:>24}" for p in PIPELINES))
    for name, r in result["faults"].items():
        cells = [r["by_pipeline"][p] for p in PIPELINES]
        print(f"{name:16}" + "".join(f" {_cell(c):>24}" for c in cells))


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def print_report(result: dict) -> None:
    print(
        f"\n{'fault':16} {'done':>4} {'moved':>5} {'resum':>5} {'fail':>4} {'hung':>4} {'broke':>5} "
        f"{'m/r':>3} {'diff':>4} {'left':>4} {'affected ok':>11} {'gap p99':>7} {'back s':>6}"
    )
    for name, r in result["faults"].items():
        left = sum((r.get("left_after_settling") or {}).values())
        share = r.get("affected_completed_share")
        aff = f"{r['affected_completed']}/{r['affected']}" if share is not None else "-"
        print(
            f"{name:16} {r['completed']:4} {r['migrated']:5} {r['resumed']:5} {r['failed_clear']:4} "
            f"{r['hung']:4} {r['broken_connections']:5} {r['missing_or_repeated']:3} {r['mismatched']:4} "
            f"{left:4} {aff:>11} {_fmt(r['migrated_max_gap_p99_s']):>7} {_fmt(r.get('recovery_s')):>6}"
        )
    _print_matrix(result)
    print()
    for name, r in result["faults"].items():
        for e in r["errors"]:
            print(f"  [{name}] error: {e}")


def figure(result: dict):
    plt = pyplot()
    names = list(result["faults"])
    rows = [result["faults"][n] for n in names]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    done = [r["completed"] - r["migrated"] - r["resumed"] for r in rows]
    moved = [r["migrated"] for r in rows]
    resumed = [r["resumed"] for r in rows]
    failed = [r["failed_clear"] for r in rows]
    ax.barh(names, done, label="completed in place")
    ax.barh(names, moved, left=done, label="after a move")
    left = [a + b for a, b in zip(done, moved, strict=True)]
    ax.barh(names, resumed, left=left, label="after a reconnect")
    left = [a + b for a, b in zip(left, resumed, strict=True)]
    ax.barh(names, failed, left=left, label="failed: error, or the connection broke")
    ax.set_xlabel("requests")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax.set_title("outcome per fault")
    bx.barh(names, [r.get("recovery_s") or 0 for r in rows])
    bx.set_xlabel("seconds from the fault until a new request succeeds")
    bx.set_title("time to recover")
    return fig
