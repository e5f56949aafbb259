"""Checking and converting raw values (YAML nodes, CLI strings) to a config field's declared type.

Owns: `coerce_value(value, hint, where)` and `parse_cli_scalar`; the error text names `where`
(a file:line, or a CLI flag) and the expected type. Knows nothing about specific sections.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config problem a user can fix; the message says where and what to do."""


class ConfigErrors(ConfigError):
    """Several config problems found in one pass; `messages` holds one line each."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = messages
        super().__init__("\n".join(messages) if len(messages) == 1 else
                         "\n".join(f"  - {m}" for m in messages))


def _is_optional(hint: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != len(typing.get_args(hint)):
            return True, args[0] if len(args) == 1 else typing.Union[tuple(args)]
    return False, hint


def type_name(hint: Any) -> str:
    optional, inner = _is_optional(hint)
    name = getattr(inner, "__name__", None) or str(inner).replace("typing.", "")
    origin = typing.get_origin(inner)
    if origin is list:
        name = f"list of {type_name(typing.get_args(inner)[0])}"
    elif origin is dict:
        name = "mapping"
    return f"{name} or null" if optional else name


def parse_cli_scalar(text: str) -> Any:
    """A CLI token as YAML would read it ('1e-6' -> float, 'true' -> bool, 'null' -> None)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) or value is None or isinstance(value, (bool, int, float, list, dict)):
        # yaml reads '1e-6' as a string (no dot): accept it as a float where it parses as one.
        if isinstance(value, str):
            try:
                return float(value) if any(c in value for c in "eE.") and not value.isalpha() else value
            except ValueError:
                return value
        return value
    return text


def coerce_value(value: Any, hint: Any, where: str) -> Any:
    """Return `value` converted to `hint`, or raise ConfigError naming `where`."""
    optional, inner = _is_optional(hint)
    if value is None:
        if optional or inner is Any:
            return None
        raise ConfigError(f"{where}: null is not allowed; expected {type_name(hint)}")
    if inner is Any:
        return value
    origin = typing.get_origin(inner)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(inner):
            try:
                return coerce_value(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} is not a {type_name(hint)}")
    if origin is list:
        (item_hint,) = typing.get_args(inner)
        if not isinstance(value, list):
            value = [value]
        return [coerce_value(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(inner):
        if isinstance(value, inner):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping with {', '.join(f.name for f in dataclasses.fields(inner))}")
        hints = typing.get_type_hints(inner)
        unknown = set(value) - set(hints)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        try:
            return inner(**{k: coerce_value(v, hints[k], f"{where}.{k}") for k, v in value.items()})
        except TypeError as error:
            raise ConfigError(f"{where}: {error}") from error
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where}: {value!r} is not a bool (use true or false)")
    if inner is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise ConfigError(f"{where}: {value!r} is not an integer")
        try:
            number = float(value) if isinstance(value, str) else value
            if float(number) != int(float(number)):
                raise ValueError
            return int(float(number))
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not an integer") from None
    if inner is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {value!r} is not a number") from None
    if inner is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value
