"""Test helper (not a test): every `Problem` of a config, whether loading refuses it (a value's type, a `Literal`'s
allowed values, a section's invariant) or validation finds it, so a test asserts on (field, code) wherever the rule
lives."""

from __future__ import annotations

from pathlib import Path

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.problems import Problem
from hpc_rl.config.validation import collect_problems


def config_problems(files: list[str | Path], flags: list[str], *, check_files: bool = False) -> list[Problem]:
    """The problems of loading `files` + `flags`, or (when it loads) of validating it."""
    try:
        config = load_config(files, flags)
    except ConfigError as error:
        problems = getattr(error, "problems", None) or ([error.problem] if error.problem is not None else [])
        assert problems, f"a load error without a located Problem: {error}"
        return problems
    return collect_problems(config, check_files=check_files)


def codes(problems: list[Problem]) -> set[tuple[str, str]]:
    """(field, code) of each problem."""
    return {(problem.field, problem.code) for problem in problems}


def message_of(problems: list[Problem], field: str) -> str:
    """The messages of `field`'s problems, joined (with the field's name in front, as the user reads them)."""
    return "\n".join(f"{p.field}: {p.message}" for p in problems if p.field == field)
