"""Checking and converting raw values (YAML nodes, CLI strings) to a config field's declared type.

Owns: `coerce_value(value, hint, where)` and `parse_cli_scalar`; the error text names `where`
(a file:line, or a CLI flag) and the expected type, and carries a `Problem` (bad_type, not_one_of, unknown_key).
A `Literal[...]` type is a field's table of allowed values: `coerce_value` refuses any other value, and
`literal_problems` checks a constructed section the same way (a section built in Python, not loaded).
Knows nothing about specific sections.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

import yaml

from hpc_rl.config.problems import Problem, ProblemCode


class ConfigError(ValueError):
    """A config problem a user can fix; the message says where and what to do (`problem`: the same as a
    `Problem`, when the raiser knows its field and code)."""

    def __init__(self, message: str, problem: Problem | None = None) -> None:
        super().__init__(message)
        self.problem = problem


class ConfigErrors(ConfigError):
    """Several config problems found in one pass: `messages` holds one line each, `problems` those of them that
    are located `Problem`s (every problem of a section's invariants and of a value's type)."""

    def __init__(self, items: list[str | Problem]) -> None:
        self.items = list(items)
        self.messages = [str(item) for item in items]
        self.problems = [item for item in items if isinstance(item, Problem)]
        super().__init__("\n".join(self.messages) if len(self.messages) == 1 else
                         "\n".join(f"  - {m}" for m in self.messages))


def _refuse(where: str, code: ProblemCode, detail: str) -> ConfigError:
    """The error for a value at `where` (its field path, after a file:line or flag when there is one)."""
    return ConfigError(f"{where}: {detail}", Problem(where, code, detail))


def allowed_values(hint: Any) -> tuple[Any, ...] | None:
    """The allowed values of a `Literal[...]` type (None and the Literal's values for an optional one), or None
    when `hint` is not a Literal."""
    optional, inner = _is_optional(hint)
    if typing.get_origin(inner) is not Literal:
        return None
    return (*typing.get_args(inner), *((None,) if optional else ()))


def literal_problems(section: Any, section_name: str) -> list[Problem]:
    """Every field of the dataclass `section` whose value is outside its `Literal[...]` type."""
    hints = typing.get_type_hints(type(section))
    problems = []
    for item in dataclasses.fields(section):
        allowed = allowed_values(hints[item.name])
        value = getattr(section, item.name)
        if allowed is not None and value not in allowed:
            problems.append(Problem(f"{section_name}.{item.name}", "not_one_of", _not_one_of(value, allowed)))
    return problems


def _not_one_of(value: Any, allowed: tuple[Any, ...]) -> str:
    return f"{value!r} is not one of {', '.join(str(a) for a in allowed if a is not None)}" + (
        " (or null)" if None in allowed else "")


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
    elif origin is Literal:  # a table of allowed values: --help shows them
        name = "|".join(str(v) for v in typing.get_args(inner))
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
        raise _refuse(where, "bad_type", f"null is not allowed; expected {type_name(hint)}")
    if inner is Any:
        return value
    origin = typing.get_origin(inner)
    if origin is Literal:
        allowed = typing.get_args(inner)
        if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
            raise _refuse(where, "not_one_of", _not_one_of(value, allowed_values(hint) or allowed))
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(inner):
            try:
                return coerce_value(value, option, where)
            except ConfigError:
                continue
        raise _refuse(where, "bad_type", f"{value!r} is not a {type_name(hint)}")
    if origin is list:
        (item_hint,) = typing.get_args(inner)
        if not isinstance(value, list):
            value = [value]
        return [coerce_value(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _refuse(where, "bad_type", f"expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(inner):
        if isinstance(value, inner):
            return value
        if not isinstance(value, dict):
            raise _refuse(where, "bad_type",
            f"expected a mapping with {', '.join(f.name for f in dataclasses.fields(inner))}")
        hints = typing.get_type_hints(inner)
        unknown = set(value) - set(hints)
        if unknown:
            raise _refuse(where, "unknown_key", f"unknown key(s) {', '.join(sorted(unknown))}")
        try:
            return inner(**{k: coerce_value(v, hints[k], f"{where}.{k}") for k, v in value.items()})
        except TypeError as error:
            raise ConfigError(f"{where}: {error}") from error
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise _refuse(where, "bad_type", f"{value!r} is not a bool (use true or false)")
    if inner is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise _refuse(where, "bad_type", f"{value!r} is not an integer")
        try:
            number = float(value) if isinstance(value, str) else value
            if float(number) != int(float(number)):
                raise ValueError
            return int(float(number))
        except ValueError:
            raise _refuse(where, "bad_type", f"{value!r} is not an integer") from None
    if inner is float:
        if isinstance(value, bool):
            raise _refuse(where, "bad_type", f"{value!r} is not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise _refuse(where, "bad_type", f"{value!r} is not a number") from None
    if inner is str:
        if isinstance(value, (dict, list)):
            raise _refuse(where, "bad_type", f"expected a string, got {value!r}")
        return str(value)
    return value
