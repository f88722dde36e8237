"""msgpack codec for typed bus messages.

A message type is a `@dataclass` subclass of `Message`. On the wire it is a msgpack map of its
fields plus `"v"`, the class's schema version. Fields may be plain types, lists, dicts, enums
(sent as their value), other messages, or plain dataclasses (sent as maps without `v`).
`decode` checks everything it can cheaply check (version, required/unknown fields, field types,
enum values) so a handler only ever sees a well-formed object.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, ClassVar, TypeVar

import msgpack


class MessageError(ValueError):
    """The bytes are not a valid encoding of the expected message type."""


@dataclasses.dataclass
class Message:
    """Base of all bus messages. Subclasses are dataclasses and may bump `V` on breaking changes."""

    V: ClassVar[int] = 2  # 2: typed enums and reports replace free strings and dicts


M = TypeVar("M", bound=Message)


def encode(msg: Message) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(cls: type[M], data: bytes) -> M:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types (ExtraData, ValueError, ...)
        raise MessageError(f"bad msgpack: {e}") from None
    return _from_wire(cls, obj, cls.__name__)


def _to_wire(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, Message):
            out["v"] = type(value).V
        return out
    if isinstance(value, list | tuple):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """(field name -> resolved type hint, names of required fields); cached per class."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a @dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    required = frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    return fields, required


def _from_wire(cls: type[M], obj: Any, path: str) -> M:
    fields, required = _schema(cls)
    if not isinstance(obj, dict):
        raise MessageError(f"{path}: expected a map, got {type(obj).__name__}")
    versioned = issubclass(cls, Message)
    if versioned and obj.get("v") != cls.V:
        raise MessageError(f"{path}: schema version {obj.get('v')!r}, expected {cls.V}")
    unknown = obj.keys() - fields.keys() - ({"v"} if versioned else set())
    if unknown:
        raise MessageError(f"{path}: unknown fields {sorted(map(str, unknown))}")
    missing = required - obj.keys()
    if missing:
        raise MessageError(f"{path}: missing fields {sorted(missing)}")
    kwargs = {name: _check(fields[name], obj[name], f"{path}.{name}") for name in fields.keys() & obj.keys()}
    return cls(**kwargs)


def _check(tp: Any, value: Any, path: str) -> Any:
    """Return `value` converted to `tp` (int->float, map->Message), or raise MessageError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        others = [a for a in args if a is not type(None)]
        if value is not None and len(others) == 1:  # Optional[X]: keep X's precise error
            return _check(others[0], value, path)
        for arg in args:
            try:
                return _check(arg, value, path)
            except MessageError:
                pass
        raise MessageError(f"{path}: {type(value).__name__} does not match {tp}")
    if tp is type(None):
        if value is None:
            return None
    elif origin is typing.Literal:
        if value in args:
            return value
    elif origin is list:
        if isinstance(value, list):
            item = args[0] if args else Any
            if item in (int, str) and all(type(v) is item for v in value):
                return value  # token ids, block hashes: the common case, checked in one pass
            return [_check(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            kt, vt = args if args else (Any, Any)
            return {_check(kt, k, f"{path}.key"): _check(vt, v, f"{path}[{k!r}]") for k, v in value.items()}
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (str, bool, bytes):
        if type(value) is tp:
            return value
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise MessageError(f"{path}: {value!r} is not one of {[m.value for m in tp]}") from None
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _from_wire(tp, value, path)
    else:
        raise TypeError(f"{path}: unsupported field type {tp!r}")
    raise MessageError(f"{path}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__}")
