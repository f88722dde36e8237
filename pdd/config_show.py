"""`pdd config show SERVICE`: every setting of a service, generated from its settings classes
(shared/config.py, and the router's HTTP limits), with the variables that set it, its default
and its value in this environment (plus any --env-file), secrets masked."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from shared.config import COMMON_PREFIX, NESTED_DELIMITER, SETTINGS, CommonSettings
from shared.env_file import EnvFileError, apply_env_files

SECRET_WORDS = ("password", "secret", "api_key")  # a field naming one of them holds a secret...
MASK = "****"


def is_secret(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(w in last for w in SECRET_WORDS) and not last.endswith("_file")  # ...not its file's path


@dataclass
class Row:
    setting: str  # dotted: model.preset
    env: tuple[str, ...]  # the variables that set it, the first that is set wins
    default: str
    current: str
    source: str = ""  # the variable it came from (and its env file); "" = the default


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if value == "":
        return '""'
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    return str(value)


def _default(field: FieldInfo) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    factory = field.default_factory
    if factory is None:
        return None
    doc = (factory.__doc__ or "").strip().split(".", 1)[0]
    return f"({doc})" if doc else f"({factory.__name__}())"  # computed per process: say how


def _env_names(prefix: str, name: str, field: FieldInfo, common: bool) -> tuple[str, ...]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return tuple(c for c in alias.choices if isinstance(c, str))
    if isinstance(alias, str):
        return (alias,)
    key = name.upper()
    return (prefix + key, *((COMMON_PREFIX + key,) if common else ()))


def _fields(cls: type[BaseModel], prefix: str) -> Iterator[tuple[str, tuple[str, ...], Any]]:
    """(dotted name, variables, default) of every field, nested models' fields one by one."""
    for name, field in cls.model_fields.items():
        common = name in CommonSettings.model_fields
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for sub, subfield in kind.model_fields.items():
                key = f"{name}{NESTED_DELIMITER}{sub}"
                yield f"{name}.{sub}", _env_names(prefix, key, subfield, common), _default(subfield)
        else:
            yield name, _env_names(prefix, name, field, common), _default(field)


def _router_http() -> Iterator[tuple[str, tuple[str, ...], Any]]:
    from services.router.api.http_settings import HttpSettings, env_names

    for f in dataclasses.fields(HttpSettings):
        yield f"http.{f.name}", env_names(f.name), f.default


def _span_store() -> Iterator[tuple[str, tuple[str, ...], Any]]:
    """The host's span store, read from the process environment by every service: one per DC
    (or per host) unless they share a filesystem on purpose."""
    from shared.telemetry.span_store import DEFAULT_MAX_BYTES, MAX_BYTES_ENV, TRACE_DIR_ENV

    yield "trace.dir", (TRACE_DIR_ENV,), "(.pdd/traces under the working directory)"
    yield "trace.max_bytes", (MAX_BYTES_ENV,), DEFAULT_MAX_BYTES


def _dig(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def rows(service: str, origins: Mapping[str, Path] | None = None) -> tuple[list[Row], list[str]]:
    """Every setting of `service` in this process's environment, and the errors that keep the
    settings from loading (each row then shows the variable's raw value)."""
    from services.router.api.http_settings import HttpSettings

    cls, origins = SETTINGS[service], origins or {}
    prefix = cls.model_config["env_prefix"]
    env = {k.upper(): v for k, v in os.environ.items()}  # pydantic reads names case-insensitively
    errors: list[str] = []
    objects: dict[str, Any] = {}
    try:
        objects["settings"] = cls()
    except ValidationError as e:
        errors += [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    fields = [("settings", *f) for f in _fields(cls, prefix)]
    if service == "router":
        try:
            objects["router"] = HttpSettings.from_env(os.environ)
        except ValueError as e:
            errors.append(str(e))
        fields += [("router", *f) for f in _router_http()]
    fields += [("environment", *f) for f in _span_store()]
    out = []
    for owner, name, names, default in fields:
        given = next((n for n in names if n in env), None)
        if owner in objects:
            current = _dig(objects[owner], name.removeprefix("http."))
        else:
            current = env[given] if given else default
        source = ""
        if given:
            source = given + (f" ({origins[given]})" if given in origins else "")
        if is_secret(name):
            default = "-" if default in (None, "", ()) else MASK
            current = "-" if current in (None, "", ()) else MASK
        out.append(Row(name, names, _show(default), _show(current), source))
    return out, errors


def render(service: str, table: list[Row]) -> str:
    prefix = SETTINGS[service].model_config["env_prefix"]
    head = (
        f"{service}: variables {prefix}<SETTING> (nested: {prefix}MODEL__PRESET); a setting every "
        f"service has is also read from {COMMON_PREFIX}<SETTING>, below the service's own.\n"
    )
    cells = [("SETTING", "ENVIRONMENT", "DEFAULT", "CURRENT")]
    cells += [
        (r.setting, " ".join(r.env), r.default, r.current + (f"  <- {r.source}" if r.source else ""))
        for r in table
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in cells]
    return head + "\n".join(line.rstrip() for line in lines) + "\n"


def show(service: str, env_files: list[Path], as_json: bool = False) -> int:
    """Print the settings (exit 2 on an unreadable env file or settings that do not load)."""
    try:
        origins = apply_env_files(env_files)
    except (OSError, EnvFileError) as e:
        print(f"pdd config show: {e}")
        return 2
    table, errors = rows(service, origins)
    if as_json:
        settings = [dataclasses.asdict(r) for r in table]
        print(json.dumps({"service": service, "settings": settings, "errors": errors}, indent=2))
    else:
        print(render(service, table), end="")
        for e in errors:
            print(f"error: {e}")
    return 2 if errors else 0
