"""`pdd top`: a live terminal view of a running system.

It reads only the router's HTTP endpoints, /v1/instances and /metrics, so it works against
`pdd up` and compose alike (compose publishes nothing else). Gathering is pure: parse the
metrics text, compute per-second rates between two scrapes, build a View; rendering (rich)
only draws a View. The WAN per MD link, the RLD share and the handoffs come from the router's
own counters of what instances report with a request's last tokens (pdd_router_*), so they
move when requests end.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdd.launch import datacenter

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
ROLES = ("prefill", "relay", "main_decode")
PIPELINES = ("p-md", "p-rld-md", "rld-only")
HTTP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Scrape:
    """What the router said at one moment."""

    at: float  # time.monotonic()
    samples: Samples
    instances: dict[str, dict]  # /v1/instances


@dataclass(frozen=True)
class InstanceRow:
    dc: str
    role: str
    instance: str
    running: int
    waiting: int
    used_blocks: int
    num_blocks: int
    held: int
    draining: bool


@dataclass(frozen=True)
class View:
    instances: list[InstanceRow]
    window_s: float  # the rates are over this many seconds (0: one scrape, no rates yet)
    requests_per_s: dict[str, float]  # by pipeline
    wan: dict[str, tuple[float, float | None]]  # MD -> (KV bytes/s it received, bandwidth estimate B/s)
    rld_share: float | None  # of the output tokens reported in the window (None: none)
    rld_share_total: float | None  # since the router started
    handoffs: dict[str, tuple[float, float]]  # mode -> (per second, total)


# ---- gathering (pure) ----------------------------------------------------------------------


def parse_metrics(text: str) -> Samples:
    """{(sample name, labels): value} of Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """The samples named `name`, summed per value of `label`."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        key = dict(labels).get(label)
        if sample == name and key is not None:
            out[key] = out.get(key, 0.0) + value
    return out


def increases(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """How much each series of a counter grew; one that went down restarted (count what it has)."""
    old = by_label(before, name, label)
    return {
        key: now - old.get(key, 0.0) if now >= old.get(key, 0.0) else now
        for key, now in by_label(after, name, label).items()
    }


def rates(before: Scrape, after: Scrape, name: str, label: str) -> dict[str, float]:
    """Per-second increase of each series of a counter between two scrapes."""
    dt = after.at - before.at
    if dt <= 0:
        return {}
    return {key: grown / dt for key, grown in increases(before.samples, after.samples, name, label).items()}


def share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def instance_rows(instances: dict[str, dict]) -> list[InstanceRow]:
    """/v1/instances as rows, by datacenter, role, then instance."""
    rows = []
    for key, info in instances.items():
        role, _, instance = key.partition("/")
        rows.append(
            InstanceRow(
                datacenter(role),
                role,
                instance,
                info["running"],
                info["waiting"],
                info["used_blocks"],
                info["num_blocks"],
                info["held"],
                info["draining"],
            )
        )
    order = {role: i for i, role in enumerate(ROLES)}
    return sorted(rows, key=lambda r: (r.dc, order.get(r.role, len(order)), r.instance))


def build_view(before: Scrape | None, after: Scrape) -> View:
    """What `pdd top` shows: the instances now, rates between the two scrapes."""
    base = before or after

    def rate(name: str, label: str) -> dict[str, float]:
        return rates(base, after, name, label) if before else {}

    tokens = increases(base.samples, after.samples, "pdd_router_output_tokens_total", "role")
    total_tokens = by_label(after.samples, "pdd_router_output_tokens_total", "role")
    bandwidth = by_label(after.samples, "pdd_wan_bandwidth_bytes_per_second", "peer")
    received = rate("pdd_router_wan_bytes_total", "md")
    handoffs = by_label(after.samples, "pdd_router_handoffs_total", "mode")
    handoff_rates = rate("pdd_router_handoffs_total", "mode")
    return View(
        instances=instance_rows(after.instances),
        window_s=after.at - base.at,
        requests_per_s=rate("pdd_requests_total", "pipeline"),
        wan={md: (received.get(md, 0.0), bandwidth.get(md)) for md in sorted({*received, *bandwidth})},
        rld_share=share(tokens.get("relay", 0.0), sum(tokens.values())) if before else None,
        rld_share_total=share(total_tokens.get("relay", 0.0), sum(total_tokens.values())),
        handoffs={mode: (handoff_rates.get(mode, 0.0), n) for mode, n in sorted(handoffs.items())},
    )


# ---- the router's endpoints ----------------------------------------------------------------


def scrape(client: httpx.Client) -> Scrape:
    """/v1/instances and /metrics of the router the client is bound to."""
    instances = client.get("/v1/instances")
    metrics = client.get("/metrics")
    for r in (instances, metrics):
        r.raise_for_status()
    return Scrape(time.monotonic(), parse_metrics(metrics.text), instances.json())


# ---- rendering -----------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _instances_tables(rows: list[InstanceRow]) -> list[Table]:
    """One table per datacenter; instance names stay whole, narrow terminals squeeze the rest."""
    tables = []
    for dc in sorted({r.dc for r in rows}):
        mine = [r for r in rows if r.dc == dc]
        names = [f"{r.role}/{r.instance}" for r in mine]
        table = Table(
            title=f"{dc} instances",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            show_edge=False,
        )
        table.add_column("instance", min_width=max(map(len, names)), no_wrap=True)
        for column in ("run", "wait", "KV blocks", "KV %", "held"):
            table.add_column(column, justify="right")
        table.add_column("state")
        for r, name in zip(mine, names, strict=True):
            table.add_row(
                name,
                str(r.running),
                str(r.waiting),
                f"{r.used_blocks}/{r.num_blocks}",
                _percent(share(r.used_blocks, r.num_blocks)),
                str(r.held),
                "draining" if r.draining else "serving",
            )
        tables.append(table)
    return tables


def _wan_table(wan: dict[str, tuple[float, float | None]]) -> Table | Text:
    if not wan:
        return Text("WAN  no KV link used yet")
    table = Table(
        title="WAN: KV into each MD, counted at request end", title_justify="left", box=box.SIMPLE_HEAD
    )
    for column in ("link", "received/s", "bandwidth estimate"):
        table.add_column(column, justify="left" if column == "link" else "right")
    for md, (received, bandwidth) in wan.items():
        estimate = "-" if bandwidth is None else f"{human_bytes(bandwidth)}/s"
        table.add_row(f"dc-a → main_decode/{md}", f"{human_bytes(received)}/s", estimate)
    return table


def render(view: View, url: str) -> Group:
    """One frame."""
    window = f" over {view.window_s:.1f} s" if view.window_s > 0 else ": after the next scrape"
    rps = view.requests_per_s
    per_pipeline = "  ".join(
        f"{p} {rps.get(p, 0.0):.2f}" for p in (*PIPELINES, *sorted(set(rps) - set(PIPELINES)))
    )
    handoffs = "  ".join(
        f"{mode} {per_s:.2f}/s ({n:.0f} in all)" for mode, (per_s, n) in view.handoffs.items()
    )
    lines = [
        Text(f"pdd top  {url}  {time.strftime('%H:%M:%S')}  rates{window}", style="bold"),
        *(_instances_tables(view.instances) or [Text("no live instances")]),
        Text(f"requests/s  {per_pipeline}  total {sum(rps.values()):.2f}"),
        _wan_table(view.wan),
        Text(
            f"RLD share of output tokens  {_percent(view.rld_share)} now, {_percent(view.rld_share_total)} in all"
        ),
        Text(f"handoffs  {handoffs or 'none yet'}"),
    ]
    return Group(*lines)


# ---- the command ---------------------------------------------------------------------------


def run_top(
    url: str,
    api_key: str | None = None,
    once: bool = False,
    interval_s: float = 1.0,
    window_s: float = 5.0,
    console: Console | None = None,
) -> int:
    """Refresh every `interval_s` with rates over the last `window_s`; `once`: two scrapes
    `interval_s` apart, one frame printed, exit."""
    console = console or Console()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=HTTP_TIMEOUT_S) as client:
        try:
            first = scrape(client)
            if once:
                time.sleep(interval_s)
                console.print(render(build_view(first, scrape(client)), url))
                return 0
            _live(client, url, first, console, interval_s, window_s)
        except httpx.HTTPError as e:
            console.print(f"pdd top: {url}: {e}", style="red")
            return 1
        except KeyboardInterrupt:
            pass
    return 0


def _live(
    client: httpx.Client, url: str, first: Scrape, console: Console, interval_s: float, window_s: float
) -> None:
    history: deque[Scrape] = deque([first])
    with Live(render(build_view(None, first), url), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval_s)
            try:
                now = scrape(client)
            except httpx.HTTPError as e:  # a router restarting: say so, keep trying
                live.update(Text(f"pdd top: {url}: {e} (retrying)", style="red"), refresh=True)
                continue
            history.append(now)
            while len(history) > 2 and now.at - history[1].at >= window_s:
                history.popleft()
            live.update(render(build_view(history[0], now), url), refresh=True)
