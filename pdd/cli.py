"""`pdd` — the command line: up, certs, serve, config, check, wan, bench, chaos, sim, trace, top."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import logging
import os
import re
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from pdd import certs as certs_cli
from pdd import serve_nats
from pdd.benchkit.catalog import bench_names, benches, listing
from pdd.launch import DTYPE_CHOICES, MAX_COUNT, PORT_BLOCK, SERVICES, UpOptions, with_base_port
from shared.config import ENGINE_KINDS, TOOL_CALL_PARSERS

ENV_FILE_HELP = (
    "KEY=VALUE lines (repeatable; a later file wins, the process environment over all); "
    "relative paths of *_FILE/_CA/_CERT/_KEY are taken from the file's directory"
)
FORWARDING = ("wan", "bench", "chaos", "sim")  # subcommands whose extra arguments belong to another main()
COUNT_HELP = {
    "prefill": f"prefill instances (1..{MAX_COUNT}); ",
    "relay": f"relay decoder instances (1..{MAX_COUNT}); ",
    "md": f"main decode instances (1..{MAX_COUNT}); ",
    "routers": f"routers, on consecutive ports from --port (1..{MAX_COUNT}); ",
    "nats_cluster": f"NATS nodes per datacenter (1..{MAX_COUNT}); ",
    "bandwidth_mbps": "WAN cap per direction, Mbit/s (0: uncapped); ",
    "model": "a Hugging Face directory or a .gguf file (llama, mistral, qwen2, qwen3); "
    "none: the embedded SmolLM2-135M-Instruct; ",
    "model_preset": "seeded random weights instead (tiny | small | medium: tests, benchmarks); ",
    "served_model_name": "the model id of the API; default: --model as given; ",
    "max_model_len": "longest prompt + output, tokens; default: the model's context length; ",
    "dtype": "auto (float32 on the CPU; the checkpoint's on a GPU) | float32 | bfloat16 | float16; ",
    "kv_cache_space": "GiB of KV cache on this machine, split among the engines (vLLM's CPU default); ",
    "tool_call_parser": "the format of the model's tool calls; none: what its chat template teaches; ",
    "engine": "the engine behind the seam (vllm: where vLLM is installed, docs/vllm.md); ",
}
FIELD_TYPES = {"max_model_len": int}  # fields whose default (None) does not tell their type
FIELD_CHOICES = {"dtype": DTYPE_CHOICES, "tool_call_parser": TOOL_CALL_PARSERS, "engine": ENGINE_KINDS}


def _add_up_options(p: argparse.ArgumentParser) -> None:
    # Flags are generated from UpOptions so the CLI and launch.py cannot disagree. Only the
    # flags given land in the namespace (SUPPRESS), so they override --base-port's layout.
    defaults = UpOptions()
    for f in dataclasses.fields(UpOptions):
        if f.name == "api_keys":
            continue  # repeatable: below
        value = getattr(defaults, f.name)
        flags = [f"--{f.name.replace('_', '-')}"] + (["--port"] if f.name == "router_port" else [])
        kind = FIELD_TYPES.get(f.name) or (type(value) if value is not None else str)
        what = COUNT_HELP.get(f.name, "")
        choices = FIELD_CHOICES.get(f.name)
        p.add_argument(
            *flags,
            dest=f.name,
            type=kind,
            choices=choices,
            default=argparse.SUPPRESS,
            help=f"{what}default: {value}",
        )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=argparse.SUPPRESS,
        help="require `Authorization: Bearer KEY` on the router (repeatable); default: open",
    )
    p.add_argument(
        "--base-port", type=int, default=None, help=f"put every port in the block N..N+{PORT_BLOCK - 1}"
    )
    p.add_argument("--smoke", action="store_true", help="start, wait healthy, run one completion, stop")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for health")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd", description="Prefill - RelayDecode - MainDecode serving")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole two-DC system on this machine")
    _add_up_options(up)

    certs = sub.add_parser(
        "certs", help="(re)create credentials (CA, certificates, local KV key); per-DC bundles"
    )
    certs.add_argument(
        "--workdir", type=Path, default=UpOptions().workdir, help="credentials go to <workdir>/secrets"
    )
    certs.add_argument("--host", action="append", default=[], help="one more host the certificates name")
    certs.add_argument("--keep", action="store_true", help="only create what is missing (what `pdd up` does)")
    certs.add_argument("--compose", action="store_true", help="also write the NATS configs compose.yaml runs")
    certs_cli.add_subcommands(certs)

    serve = sub.add_parser(
        "serve",
        help="run one service (python -m services.<name>), or a DC's NATS server",
        epilog="Settings come from the environment and --env-file; "
        "`pdd config show SERVICE` lists every one with its variable, default and current value.",
    )
    serve.add_argument("service", choices=(*SERVICES, "nats"))
    serve.add_argument("--env-file", action="append", type=Path, default=[], help=ENV_FILE_HELP)
    serve_nats.add_arguments(serve)

    config = sub.add_parser("config", help="inspect a service's settings").add_subparsers(
        dest="config_command", required=True
    )
    show = config.add_parser("show", help="every setting: its variable, default and current value")
    show.add_argument("service", choices=SERVICES)
    show.add_argument("--env-file", action="append", type=Path, default=[], help=ENV_FILE_HELP)
    show.add_argument("--json", action="store_true", help="print JSON instead of the table")

    check = sub.add_parser(
        "check",
        help="preflight of this host of a datacenter: NATS, gateway, certificate names, MD's bulk address, clocks",
    )
    check.add_argument(
        "--bundle", type=Path, default=None, help="this DC's bundle directory (pdd certs bundle)"
    )
    check.add_argument(
        "--env-file",
        type=Path,
        action="append",
        default=[],
        help="KEY=VALUE settings (repeatable; after the bundle's)",
    )
    check.add_argument(
        "--service",
        choices=SERVICES,
        default=None,
        help="whose credentials (bundle default: dc-a router, dc-b main_decode)",
    )
    check.add_argument(
        "--nats-url", default=None, metavar="URL", help="NATS URL(s) to check, over the settings' own"
    )
    check.add_argument(
        "--md-bulk",
        action="append",
        default=[],
        help="MD bulk address tcp://host:port (repeatable); default: from MD's load reports",
    )
    check.add_argument(
        "--monitor",
        default=None,
        help="this DC's NATS monitoring URL, for /gatewayz (e.g. http://127.0.0.1:8222)",
    )
    check.add_argument(
        "--gateway-url",
        action="append",
        default=[],
        metavar="URL",
        help="the other DC's gateway as this DC's server dials it, to check its certificate (repeatable)",
    )
    check.add_argument("--timeout", type=float, default=3.0, help="seconds each probe may take")

    sub.add_parser("wan", help="the WAN emulator; arguments go to it", add_help=False)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark (`pdd bench --help` lists them); extra arguments go to it",
        add_help=False,
    )
    bench.add_argument("name", nargs="?", choices=bench_names(), metavar="NAME")  # --help: the bench's own

    sub.add_parser(
        "chaos",
        help="start a system and inject faults into it under load (= pdd bench chaos)",
        add_help=False,
    )

    sub.add_parser(
        "sim",
        help="the fleet simulator: run, calibrate, validate, paper, plan, profiles "
        "(`pdd sim --help`); extra arguments go to it",
        add_help=False,
    )

    trace = sub.add_parser("trace", help="show one request's trace from the local span store")
    trace.add_argument("id", help="request id (x-request-id) or 32-hex trace id")
    trace.add_argument(
        "--dir", type=Path, default=None, help="span store (default: $PDD_TRACE_DIR or .pdd/traces)"
    )
    trace.add_argument("--json", action="store_true", help="print JSON instead of the waterfall")

    restart = sub.add_parser(
        "restart",
        help="rolling restart of one process of a running `pdd up` (SIGTERM: it drains, then starts again)",
    )
    restart.add_argument(
        "name", help="its process name, as in `pdd up`'s log and <workdir>/run (e.g. router-1)"
    )
    restart.add_argument("--workdir", type=Path, default=UpOptions().workdir)

    top = sub.add_parser(
        "top", help="live view of a running system, from its router's /v1/instances and /metrics"
    )
    top.add_argument(
        "--url",
        default=None,
        help="the router (default: the first router of `pdd up`, "
        f"http://127.0.0.1:{UpOptions().router_port})",
    )
    top.add_argument("--api-key", default=None, help="when the router requires one (`pdd up --api-key`)")
    top.add_argument(
        "--once", action="store_true", help="print one frame (two scrapes --interval apart) and exit"
    )
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes; default: 1")
    top.add_argument("--window", type=float, default=5.0, help="rates over the last N seconds; default: 5")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Parsed namespace plus the arguments forwarded to `wan`/`bench`."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in FORWARDING:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args, extra


def up_options(args: argparse.Namespace) -> UpOptions:
    opts = UpOptions() if args.base_port is None else with_base_port(UpOptions(), args.base_port)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(UpOptions) if hasattr(args, f.name)}
    if "api_keys" in given:
        given["api_keys"] = tuple(given["api_keys"])
    try:
        return dataclasses.replace(opts, **given)
    except ValueError as e:  # a count out of range, ports that collide
        print(f"pdd up: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_up(args: argparse.Namespace) -> int:
    from pdd.up import run_up  # lazy: pulls in httpx and the NATS launcher

    return asyncio.run(run_up(up_options(args), smoke=args.smoke, start_timeout_s=args.start_timeout))


def cmd_certs(args: argparse.Namespace) -> int:
    if args.certs_command:
        return certs_cli.run(args)
    from pdd.launch import COMPOSE_HOSTS, nats_specs
    from shared.security.credentials import Credentials
    from shared.security.pki import write_private

    opts = UpOptions(workdir=args.workdir)
    creds = Credentials(args.workdir.resolve() / "secrets").ensure(SERVICES, args.host, renew=not args.keep)
    if args.compose:
        from shared.bus.nats_config import NatsConfig, nats_users

        for spec in nats_specs(opts, COMPOSE_HOSTS):
            conf = NatsConfig(
                spec.name,
                f"{COMPOSE_HOSTS.bind}:{spec.port}",
                "127.0.0.1:8222",
                tls=creds.identity(spec.identity),
                users=nats_users(SERVICES),
                gateway_listen=f"{COMPOSE_HOSTS.bind}:{spec.gateway_port}",
                gateway_advertise=spec.advertise,
                gateways=spec.gateways,
            )
            write_private(creds.dir / f"{spec.name}.conf", conf.render().encode())
    print(f"pdd certs: credentials in {creds.dir}")
    return 0


def _run_module(module: str, argv: list[str]) -> int:
    """Run `python -m module` in this process, with `argv` as its arguments."""
    saved = sys.argv
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.service == "nats":
        return serve_nats.serve_nats(args)
    from shared.env_file import EnvFileError, apply_env_files

    try:
        apply_env_files(args.env_file)
    except (OSError, EnvFileError) as e:
        print(f"pdd serve: {e}", file=sys.stderr)
        return 2
    return _run_module(f"services.{args.service}", [])


def cmd_config(args: argparse.Namespace) -> int:
    from pdd.config_show import show

    return show(args.service, args.env_file, as_json=args.json)


def cmd_wan(extra: list[str]) -> int:
    from shared.wan.cli import main as wan_main

    return wan_main(extra)


def cmd_bench(name: str | None, extra: list[str]) -> int:
    """Run bench `name` with `extra` as its arguments (its --help too); no name: list the benches."""
    if name is not None:
        module = importlib.import_module(f"bench.{name}")
        return int(module.main(extra) or 0)
    asked = "-h" in extra or "--help" in extra
    print(listing(benches()), end="", file=sys.stdout if asked else sys.stderr)
    return 0 if asked else 2


def cmd_sim(extra: list[str]) -> int:
    from pdd.sim.cli import main as sim_main  # lazy: a simulation may import torch and numpy

    return sim_main(extra)


def cmd_trace(args: argparse.Namespace) -> int:
    from shared.telemetry.span_store import default_trace_dir, find_trace_id, load_trace
    from shared.telemetry.waterfall import render_waterfall, trace_to_json

    directory = args.dir or default_trace_dir()
    spans = load_trace(directory, args.id) if re.fullmatch(r"[0-9a-fA-F]{32}", args.id) else []
    if not spans and (trace_id := find_trace_id(directory, args.id)):
        spans = load_trace(directory, trace_id)
    if not spans:
        print(f"pdd trace: no trace for {args.id!r} in {directory}", file=sys.stderr)
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            print(
                "  (OTEL_EXPORTER_OTLP_ENDPOINT is set: spans go to the OTLP collector, e.g. Jaeger)",
                file=sys.stderr,
            )
        return 1
    if args.json:
        print(json.dumps(trace_to_json(spans), indent=2))
    else:
        print(render_waterfall(spans), end="")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from pdd.launch import router_urls
    from pdd.top import run_top

    url = args.url or router_urls(UpOptions())[0]
    return run_top(
        url.rstrip("/"), args.api_key, once=args.once, interval_s=args.interval, window_s=args.window
    )


def cmd_restart(args: argparse.Namespace) -> int:
    from pdd.supervisor import request_restart

    try:
        pid = request_restart(args.workdir, args.name)
    except LookupError as e:
        print(f"pdd restart: {e}")
        return 1
    print(f"{args.name} (pid {pid}) told to drain; `pdd up` starts it again once it exits")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pdd %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    if args.command == "up":
        return cmd_up(args)
    if args.command == "top":
        return cmd_top(args)
    if args.command == "restart":
        return cmd_restart(args)
    if args.command == "certs":
        return cmd_certs(args)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "config":
        return cmd_config(args)
    if args.command == "check":
        from pdd.check import main as check_main

        return check_main(args)
    if args.command == "wan":
        return cmd_wan(extra)
    if args.command == "bench":
        return cmd_bench(args.name, extra)
    if args.command == "chaos":
        return cmd_bench("chaos", extra)
    if args.command == "sim":
        return cmd_sim(extra)
    return cmd_trace(args)


if __name__ == "__main__":
    raise SystemExit(main())
