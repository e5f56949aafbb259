"""One thing wrong with a run's config, as every check reports it: which field, which rule, what to do, and where.

Owns: the `Problem` type every rule module of `hpc_rl.config` returns (sections' own invariants included:
`SectionProblems`), the table of problem codes (`ProblemCode`), and `locate`, which gives each problem the file:line
or command-line flag that set its field. `validation` collects them and raises `ValidationFailed`; `loading` raises
`ConfigErrors` carrying them. Tests assert on (field, code); the message is for the user.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

ProblemCode = Literal[
    "out_of_range",    # a number outside its allowed range (NaN and infinity included)
    "not_one_of",      # a value outside its field's allowed values
    "bad_type",        # a value of the wrong type (a string for an integer)
    "unknown_key",     # a key or flag the config does not have
    "not_divisible",   # a size that does not divide another (batch, GPUs, heads, layers, experts)
    "needs",           # a setting that needs another one (or another value of it)
    "unused",          # a setting read only with another one, which is not given
    "conflict",        # two settings that exclude each other
    "unsupported",     # a combination hpc_rl, Megatron or SGLang does not build or refuses
    "mismatch",        # two sources that disagree (model file vs config.json, teacher vs student tokenizer)
    "not_found",       # a path that does not exist
    "bad_file",        # a file that exists but cannot be used (bad rows, not a model directory, bad JSON)
    "plugin",          # a plug-in import path that does not import or has the wrong signature
    "memory",          # the per-GPU memory plan does not fit
]
PROBLEM_CODES: tuple[str, ...] = get_args(ProblemCode)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the config: the field (section.name, or a file for file problems), the rule broken
    (`code`, one of `ProblemCode`), a message saying what is wrong and what to do, and where the field was set
    (file:line or a command-line flag; "" when it was not set: a default)."""

    field: str
    code: ProblemCode
    message: str
    location: str = ""

    def __post_init__(self) -> None:
        if self.code not in PROBLEM_CODES:
            raise ValueError(f"problem code {self.code!r} is not one of {', '.join(PROBLEM_CODES)}")

    @property
    def where(self) -> str:
        """The field (the name older callers used)."""
        return self.field

    def at(self, location: str) -> Problem:
        """This problem, located at `location` (file:line or a flag)."""
        return dataclasses.replace(self, location=location)

    def __str__(self) -> str:
        prefix = f"{self.location}: " if self.location else ""
        return f"{prefix}{self.field}: {self.message}"


class SectionProblems(ValueError):
    """Raised by a section's `__post_init__` with every invariant it breaks, each a `Problem` naming its own field,
    so that loading locates each at the line that set that field (not at the section's first setting)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def raise_problems(problems: list[Problem]) -> None:
    """Raise SectionProblems when a section's `__post_init__` found any."""
    if problems:
        raise SectionProblems(problems)


_LOCATIONS = "_setting_locations"
"""The attribute of a loaded config that holds where each field was set (not a dataclass field: never written)."""


def remember_locations(config: object, wheres: Mapping[str, str]) -> None:
    """Keep on `config` where each of its fields was set (field path -> file:line or flag), for validation."""
    object.__setattr__(config, _LOCATIONS, dict(wheres))


def setting_locations(config: object) -> Mapping[str, str]:
    """Where each field of a loaded config was set ({} for a config built in Python)."""
    return getattr(config, _LOCATIONS, {})


def locate(problems: Iterable[Problem], wheres: Mapping[str, str]) -> list[Problem]:
    """Each problem located at the setting of its field (`wheres`: field path -> file:line or flag); a problem on
    an item of a list field (`x.y[2]`) at the list's setting; one without a setting (a default) keeps ""."""
    located = []
    for problem in problems:
        key = problem.field.split("[")[0]
        where = wheres.get(key) or problem.location
        located.append(problem.at(where) if where and not problem.location else problem)
    return located
