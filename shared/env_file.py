"""Env files: the settings of one service as KEY=VALUE lines (`pdd serve SERVICE --env-file F`).

A line is `KEY=VALUE` (an optional leading `export ` is allowed); blank lines and lines starting
with `#` are skipped, and so is ` #...` after an unquoted value. A value may be quoted: '...' is
taken as is, "..." knows the escapes \\" \\\\ \\n. A relative value of a key ending in _FILE,
_CA, _CERT or _KEY is a path, resolved against the file's directory, so a bundle directory can
be copied anywhere. The process environment wins over every file (an operator overrides one
value without editing the file); among files, a later one wins over an earlier one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

PATH_SUFFIXES = ("_FILE", "_CA", "_CERT", "_KEY")
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ESCAPES = {'"': '"', "\\": "\\", "n": "\n"}


class EnvFileError(ValueError):
    pass


def _value(raw: str, where: str) -> str:
    raw = raw.strip()
    if raw[:1] == "'":
        end = raw.find("'", 1)
        if end < 0:
            raise EnvFileError(f"{where}: unterminated '")
        rest, value = raw[end + 1 :], raw[1:end]
    elif raw[:1] == '"':
        out, i = [], 1
        while i < len(raw) and raw[i] != '"':
            if raw[i] == "\\" and i + 1 < len(raw):
                i += 1
                out.append(ESCAPES.get(raw[i], "\\" + raw[i]))
            else:
                out.append(raw[i])
            i += 1
        if i >= len(raw):
            raise EnvFileError(f'{where}: unterminated "')
        rest, value = raw[i + 1 :], "".join(out)
    else:
        return "" if raw.startswith("#") else re.split(r"\s+#", raw, maxsplit=1)[0].rstrip()
    if rest.strip() and not rest.strip().startswith("#"):
        raise EnvFileError(f"{where}: text after the closing quote: {rest.strip()!r}")
    return value


def parse_env_file(path: Path) -> dict[str, str]:
    """The variables `path` sets, relative paths resolved (EnvFileError on a malformed line)."""
    base = path.resolve().parent
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{n}"
        key, eq, raw = line.removeprefix("export ").partition("=")
        key = key.strip()
        if not eq or not KEY.fullmatch(key):
            raise EnvFileError(f"{where}: expected KEY=VALUE, got {line!r}")
        value = _value(raw, where)
        if value and key.upper().endswith(PATH_SUFFIXES) and not os.path.isabs(os.path.expanduser(value)):
            value = str(base / value)
        out[key] = value
    return out


def env_from_files(paths: Iterable[Path], environ: Mapping[str, str]) -> dict[str, tuple[str, Path]]:
    """What the files add to `environ`: each variable it lacks, with its value and the file it
    came from (the last file naming it)."""
    added: dict[str, tuple[str, Path]] = {}
    for path in paths:
        for key, value in parse_env_file(path).items():
            if key not in environ:
                added[key] = (value, path)
    return added


def apply_env_files(paths: Iterable[Path], environ: MutableMapping[str, str] = os.environ) -> dict[str, Path]:
    """Set what the files add in `environ`; returns each variable set and the file it came from."""
    added = env_from_files(paths, environ)
    environ.update({k: v for k, (v, _) in added.items()})
    return {k: path for k, (_, path) in added.items()}
