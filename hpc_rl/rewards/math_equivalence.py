"""Is a given math answer equal to the ground truth? The mathd and sympy checks slime's graders use.

Owns: `equal_mathd` (normalised strings equal), `equal_under_sympy` (normalise, split tuples and
intervals, compare element-wise: unreduced fractions must match exactly, an integer never equals a
non-integer, everything else must simplify to a zero difference) and `answers_match` (either).
It does not extract answers from responses (see `boxed_answer`) nor normalise strings itself (see
`math_normalize`).

sympy only sees expressions with at most two distinct letters and no `^{`, `^(`, `^12`, `^2^`
(slime's guards against hanging or evaluating arbitrary text), within `sympy_bound`'s caps and time
limit; a parse or simplify failure, a refusal or a time-out means "not equal", never an error.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from hpc_rl.rewards.sympy_bound import run_bounded, within_bounds
from hpc_rl.rewards.math_normalize import (
    is_integer_string,
    normalize_for_sympy,
    normalize_mathd,
    strip_thousands_commas,
)

_FORBIDDEN_SUBSTRINGS = ("^{", "^(")
_FORBIDDEN_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_BRACKETS = "()[]"
# `.?` is any character, as in slime: `3./4` and `3/4x` also count as fractions.
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_PLAIN_INTEGER = re.compile(r"^-?[0-9]+$")


def _distinct_letters(expr: str) -> int:
    expr = expr.replace("sqrt", "").replace("frac", "")
    return len({char for char in expr if char.isalpha()})


def _safe_for_sympy(expr: str) -> bool:
    if _distinct_letters(expr) > 2:
        return False
    if any(bad in expr for bad in _FORBIDDEN_SUBSTRINGS):
        return False
    return not any(pattern.search(expr) for pattern in _FORBIDDEN_PATTERNS)


@functools.cache
def _sympy() -> tuple[Any, Any, tuple[Any, ...]]:
    """sympy, its parser and the transformations, imported on first use (a 40 MB, seconds-long
    import the controller does not pay unless a math reward meets a non-trivial answer)."""
    import sympy
    from sympy.parsing import sympy_parser

    return sympy, sympy_parser, (*sympy_parser.standard_transformations,
                                 sympy_parser.implicit_multiplication_application)


def sympy_difference_is_zero(ground_truth: str, given: str, tol: float = 0.0) -> bool:
    """True when sympy simplifies `(ground_truth)-(given)` to 0 (both already normalised; with `tol` > 0, to a
    number within tol of 0: slime's geo3k grader), within the bounds of `sympy_bound` (a refusal or a time-out is
    "not equal", noted for the caller)."""
    difference = f"({ground_truth})-({given})"
    if not _safe_for_sympy(difference) or not within_bounds(difference):
        return False
    try:
        sympy, sympy_parser, transformations = _sympy()  # imported before the timer starts: never cut mid-import

        def simplifies_to_zero() -> bool:
            parsed = sympy_parser.parse_expr(difference.replace("^", "**"), transformations=transformations)
            simplified = sympy.simplify(parsed)
            return bool(simplified == 0) if tol == 0 else bool(abs(simplified) <= tol)

        return bool(run_bounded(simplifies_to_zero, difference))
    except Exception:  # noqa: BLE001 -- sympy raises many types on odd text; slime treats all as unequal
        return False


def split_tuple(expr: str) -> list[str]:
    """Elements of a tuple or interval `(a, b]`; anything else is one element. Empty -> []."""
    expr = strip_thousands_commas(expr)
    if not expr:
        return []
    is_bracketed = (
        len(expr) > 2
        and expr[0] in _BRACKETS
        and expr[-1] in _BRACKETS
        and not any(char in expr[1:-1] for char in _BRACKETS)
    )
    if not is_bracketed:
        return [expr]
    return [element.strip() for element in expr[1:-1].split(",")]


def _elements_equal(ground_truth: str, given: str, tol: float = 0.0) -> bool:
    if _PLAIN_INTEGER.match(ground_truth) and _PLAIN_INTEGER.match(given):
        # What sympy would decide, without it: ~6 ms per call on the controller's event loop, paid for
        # every wrong integer answer (DAPO-Math's labels are integers); measured by bench_scale.py.
        return abs(int(ground_truth) - int(given)) <= tol
    if _FRACTION.search(ground_truth) and _FRACTION.search(given):
        return ground_truth == given  # `2/4` must not be accepted for `1/2`
    if is_integer_string(ground_truth) != is_integer_string(given):
        return False  # an integer answer needs an integer, not something that simplifies to it
    return sympy_difference_is_zero(ground_truth, given, tol)


def equal_under_sympy(given: str | None, ground_truth: str | None, tol: float = 0.0) -> bool:
    """slime's `grade_answer_sympy`: normalise both, then compare tuples/intervals element-wise (numbers within
    `tol` of each other count as equal where sympy decides; fractions must still match exactly)."""
    truth = normalize_for_sympy(ground_truth)
    answer = normalize_for_sympy(given)
    if truth is None or answer is None:
        return False
    if truth == answer:
        return True
    if not answer:
        return False
    truth_elements = split_tuple(truth)
    answer_elements = split_tuple(answer)
    if len(truth_elements) > 1 and (truth[0] != answer[0] or truth[-1] != answer[-1]):
        return False  # `(1,2]` vs `[1,2]`: the brackets must match
    if len(truth_elements) != len(answer_elements):
        return False
    return all(_elements_equal(t, a, tol) for t, a in zip(truth_elements, answer_elements))


def equal_mathd(given: str | None, ground_truth: str | None) -> bool:
    """slime's `grade_answer_mathd`: the MATH-normalised strings are equal."""
    return normalize_mathd(ground_truth) == normalize_mathd(given)


def answers_match(given: str, ground_truth: str | None) -> bool:
    """The grade both deepscaler and math use: mathd match, else sympy match."""
    return equal_mathd(given, ground_truth) or equal_under_sympy(given, ground_truth)
