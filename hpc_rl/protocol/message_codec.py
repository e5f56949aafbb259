"""Conversion between a message and (a JSON header, a list of arrays), with each field checked against its
annotation on both ends (clear errors for unknown types, version mismatches and fields that do not fit).

Owns ``encode_message``/``decode_message`` and the array placeholder; it does not own bytes on the wire
(framing.py, arrays.py). It finds classes in message_base.REGISTRY, which holds every message once
``hpc_rl.protocol.messages`` is imported.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal

import numpy as np

from hpc_rl.protocol.arrays import is_array
from hpc_rl.protocol.errors import FieldMismatchError, MalformedFrameError, UnknownMessageError
from hpc_rl.protocol.message_base import REGISTRY, Message

ARRAY_REF = "$a"
"""Key of the placeholder ``{"$a": index}`` that stands for an array inside the JSON fields."""


def _encode_value(value: Any, arrays: list[Any], where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if is_array(value):
        arrays.append(value)
        return {ARRAY_REF: len(arrays) - 1}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_encode_value(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if ARRAY_REF in value:
            raise FieldMismatchError(f"{where}: dict key {ARRAY_REF!r} is reserved for array references")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise FieldMismatchError(f"{where}: dict keys must be str, got {k!r}")
            out[k] = _encode_value(v, arrays, f"{where}[{k!r}]")
        return out
    raise FieldMismatchError(
        f"{where}: cannot send a {type(value).__name__}; allowed are None, bool, int, float, str, lists, "
        "dicts with str keys, numpy arrays and CPU torch tensors"
    )


def _decode_value(value: Any, arrays: list[Any], where: str) -> Any:
    if isinstance(value, list):
        return [_decode_value(v, arrays, where) for v in value]
    if isinstance(value, dict):
        if ARRAY_REF in value:
            index = value[ARRAY_REF]
            if len(value) != 1 or not isinstance(index, int) or not 0 <= index < len(arrays):
                raise MalformedFrameError(
                    f"{where}: bad array reference {value!r} ({len(arrays)} arrays sent)"
                )
            return arrays[index]
        return {k: _decode_value(v, arrays, where) for k, v in value.items()}
    return value


Check = typing.Callable[[Any], "str | None"]
"""Why a value does not fit a field's annotation (outer types and container elements), or None if it fits."""


def _fits(value: Any) -> None:
    return None


def _plain(test: typing.Callable[[Any], bool], expected: str) -> Check:
    return lambda value: None if test(value) else f"expected {expected}, got {type(value).__name__}"


def _number(kind: type) -> typing.Callable[[Any], bool]:
    return lambda value: isinstance(value, kind) and not isinstance(value, bool)


_PLAIN: dict[Any, Check] = {
    type(None): _plain(lambda value: value is None, "None"),
    np.ndarray: _plain(is_array, "an array"),
    float: _plain(_number((int, float)), "float"),  # type: ignore[arg-type]
    int: _plain(_number(int), "int"),
    bool: _plain(lambda value: isinstance(value, bool), "bool"),
    str: _plain(lambda value: isinstance(value, str), "str"),
}


def _check_of(hint: Any) -> Check:
    """The check of one annotation, built once per message class (a message is checked on both ends)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _PLAIN:
        return _PLAIN[hint]
    if origin is typing.Union or origin is types.UnionType:
        options = [_check_of(option) for option in args]
        return lambda value: None if any(c(value) is None for c in options) else f"{value!r:.80} is none of {hint}"
    if origin is Literal:
        return lambda value: None if value in args else f"{value!r:.80} is not one of {args}"
    if origin in (list, tuple) or hint in (list, tuple):
        item = _check_of(args[0]) if len(args) == 1 or (origin is tuple and args[1:] == (Ellipsis,)) else _fits

        def check_list(value: Any) -> str | None:
            if not isinstance(value, (list, tuple)):
                return f"expected a list, got {type(value).__name__}"
            errors = (f"item {i}: {e}" for i, v in enumerate(value) if (e := item(v)) is not None)
            return None if item is _fits else next(errors, None)

        return check_list
    if origin is dict or hint is dict:
        entry = _check_of(args[1]) if len(args) == 2 else _fits

        def check_dict(value: Any) -> str | None:
            if not isinstance(value, dict):
                return f"expected a dict, got {type(value).__name__}"
            errors = (f"key {k!r}: {e}" for k, v in value.items() if (e := entry(v)) is not None)
            return None if entry is _fits else next(errors, None)

        return check_dict
    return _fits  # Any, type variables, other annotations (custom classes): not checked


_CHECKS: dict[type, dict[str, Check]] = {}


def _check_fields(cls: type[Message], values: dict[str, Any]) -> None:
    checks = _CHECKS.get(cls)
    if checks is None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001  (an unresolvable annotation: skip type checks for the class)
            hints = {}
        checks = _CHECKS[cls] = {f.name: _check_of(hints[f.name]) for f in fields(cls) if f.name in hints}
    for name, value in values.items():
        if name in checks and (err := checks[name](value)) is not None:
            raise FieldMismatchError(f"{cls.__name__}.{name}: {err}")


def encode_message(msg: Message) -> tuple[dict[str, Any], list[Any]]:
    """(header dict with type, version and JSON fields; arrays referenced from the fields, in order)."""
    cls = type(msg)
    if REGISTRY.get(cls.TYPE) is not cls:
        raise UnknownMessageError(f"{cls.__name__} is not a registered message class")
    values = {f.name: getattr(msg, f.name) for f in fields(msg)}
    _check_fields(cls, values)
    arrays: list[Any] = []
    encoded = {name: _encode_value(v, arrays, f"{cls.__name__}.{name}") for name, v in values.items()}
    return {"type": cls.TYPE, "v": cls.VERSION, "fields": encoded}, arrays


def decode_message(header: dict[str, Any], arrays: list[Any]) -> Message:
    """The message a header (and its decoded arrays) describes; clear errors for unknown or bad ones."""
    type_name, version, raw = header.get("type"), header.get("v"), header.get("fields")
    cls = REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise UnknownMessageError(
            f"unknown message type {type_name!r}; this side knows {', '.join(sorted(REGISTRY))} "
            "(are both sides running the same hpc_rl version?)"
        )
    if version != cls.VERSION:
        raise UnknownMessageError(
            f"message {type_name!r} version mismatch: the peer sent v{version}, this side speaks v{cls.VERSION}"
        )
    if not isinstance(raw, dict):
        raise MalformedFrameError(f"message {type_name!r}: 'fields' must be an object")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    missing = sorted(
        n for n, f in known.items() if n not in raw and f.default is MISSING and f.default_factory is MISSING
    )
    if unknown or missing:
        raise FieldMismatchError(
            f"message {type_name!r} v{version} does not match {cls.__name__}: "
            f"unknown fields {unknown}, missing fields {missing}"
        )
    values = {n: _decode_value(v, arrays, f"{cls.__name__}.{n}") for n, v in raw.items()}
    _check_fields(cls, values)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:  # a __post_init__ invariant of the class
        raise FieldMismatchError(f"message {type_name!r}: {e}") from None
