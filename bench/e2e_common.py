"""What both scenarios of bench/e2e.py share: the small preset's KV size and block, the
milliseconds format, the config as written to the JSON."""

from __future__ import annotations

import argparse
import math

KV_BYTES_PER_TOKEN = 16 * 1024  # small preset, fp32
BLOCK = 16  # tokens per KV block


def fmt_ms(x: float) -> str:
    return "   -  " if x is None or math.isnan(x) else f"{x * 1000:6.0f}"


def config_of(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k != "out"}
