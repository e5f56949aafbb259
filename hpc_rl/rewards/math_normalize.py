"""String normalisation of math answers, as slime's math graders do it before comparing.

Owns two normalisers, kept apart because slime keeps them apart and they disagree on purpose:

- `normalize_mathd`: the MATH-dataset (Hendrycks) clean-up: drop `\\left`/`\\right`, degrees, `\\$`,
  `\\%`, a trailing `\\text{ unit}`, a short `k =` prefix; spell `\\frac12`, `\\sqrt3`, `a/b` and
  `0.5` the canonical way. Two answers are equal when their normalised strings are equal.
- `normalize_for_sympy`: the looser clean-up that runs before the sympy check: drop units and
  currency words, turn LaTeX into plain text (pylatexenc), lower-case, canonical integers.

It does not decide equality (see `math_equivalence`). Every quirk here (which units, the order of
the replacements, what happens on malformed input) mirrors slime's `rm_hub/math_utils.py`, because
rewards must not change when a recipe moves from slime to hpc_rl.
"""

from __future__ import annotations

import contextlib
import re

from pylatexenc import latex2text

_ENCLOSING_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_UNIT_WORDS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
    "year", "foot", "feet", "inch", "yard",
)  # fmt: skip
_UNIT_PATTERNS = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNIT_WORDS)
_DEGREE_SIGN = re.compile(r"\^ *\\circ")
_THIN_SPACE_AFTER_COMMA = re.compile(r",\\! *")
_SPACES_AFTER_MINUS = re.compile(r"- *")
_PLAIN_TEXT_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


class _Unnormalisable(Exception):
    """Raised inside `normalize_mathd` where slime's clean-up hits malformed LaTeX and gives up."""


# ----------------------------------------------------------------------------------------------
# Helpers shared with math_equivalence


def strip_thousands_commas(expr: str) -> str:
    """`1,234,567` -> `1234567`, leaving tuple commas such as `(1,2)` alone."""
    while True:
        stripped = _THOUSANDS_COMMA.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _is_near_integer(value: float) -> bool:
    try:
        return abs(value - round(value)) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def is_integer_string(expr: str) -> bool:
    """True for strings that parse as a float within 1e-7 of an integer (`12`, `1,000`, `3.0`)."""
    try:
        value = float(strip_thousands_commas(expr))
    except ValueError:
        return False
    return _is_near_integer(value)


# ----------------------------------------------------------------------------------------------
# MATH-dataset (Hendrycks) normalisation


def _unwrap_enclosing_text(answer: str) -> str:
    match = _ENCLOSING_TEXT.search(answer)
    return match.group("text") if match is not None else answer


def _drop_units_after_text_space(string: str) -> str:
    # In MATH, `\text{ ` only ever introduces a unit on the right.
    if "\\text{ " not in string:
        return string
    pieces = string.split("\\text{ ")
    if len(pieces) != 2:
        raise _Unnormalisable("more than one `\\text{ ` unit")
    return pieces[0]


def _brace_sqrt_argument(string: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}` (one character only, as in MATH)."""
    if "\\sqrt" not in string:
        return string
    first, *rest = string.split("\\sqrt")
    out = [first]
    for piece in rest:
        if not piece:
            raise _Unnormalisable("`\\sqrt` without an argument")
        out.append("\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:])
    return "".join(out)


def _brace_frac_arguments(string: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`; `\\frac{72}1` stays as is."""
    first, *rest = string.split("\\frac")
    out = [first]
    for piece in rest:
        if not piece:
            raise _Unnormalisable("`\\frac` without arguments")
        out.append("\\frac")
        if piece[0] == "{":
            out.append(piece)
            continue
        if len(piece) < 2:
            return string
        numerator, second, tail = piece[0], piece[1], piece[2:]
        if second != "{":
            out.append("{" + numerator + "}{" + second + "}" + tail)
        else:
            out.append("{" + numerator + "}" + second + tail)
    return "".join(out)


def _slash_to_frac(string: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are plain integers."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    if string != f"{numerator}/{denominator}":
        return string
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _hendrycks_clean(string: str) -> str:
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        string = string.replace(old, new)
    string = _drop_units_after_text_space(string)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `k = 5`, `x=5`
        string = sides[1]
    string = _brace_sqrt_argument(string)
    string = string.replace(" ", "")
    string = _brace_frac_arguments(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _slash_to_frac(string)


def normalize_mathd(answer: str | None) -> str | None:
    """MATH-dataset normalisation of one answer string (None stays None).

    On malformed LaTeX (`\\frac` or `\\sqrt` at the very end, two `\\text{ ` units) the answer is
    returned with only surrounding whitespace and an enclosing `\\text{...}` removed, as in slime.
    """
    if answer is None:
        return None
    answer = answer.strip()
    match = _ENCLOSING_TEXT.search(answer)
    if match is not None:
        answer = match.group("text").strip()
    try:
        return _hendrycks_clean(answer)
    except _Unnormalisable:
        return answer


# ----------------------------------------------------------------------------------------------
# Normalisation before the sympy check


def latex_to_plain(expr: str) -> str:
    """LaTeX -> text sympy can parse (`\\frac{1}{2}` -> `1/2`, `\\pi` -> `pi`), via pylatexenc."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # so a mixed number `3\frac12` keeps its space
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, name in _PLAIN_TEXT_SYMBOLS:
        expr = expr.replace(symbol, name)
    return expr.strip()


def normalize_for_sympy(expr: str | None) -> str | None:
    """The clean-up slime applies before trying sympy (None stays None)."""
    if expr is None:
        return None
    expr = _unwrap_enclosing_text(expr)
    for old, new in (
        ("\\%", "%"),
        ("\\$", "$"),
        ("$", ""),
        ("%", ""),
        (" or ", " , "),
        (" and ", " , "),
        ("million", "*10^6"),
        ("billion", "*10^9"),
        ("trillion", "*10^12"),
    ):
        expr = expr.replace(old, new)
    for unit_pattern in _UNIT_PATTERNS:
        expr = unit_pattern.sub("", expr)
    expr = _DEGREE_SIGN.sub("", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = _THIN_SPACE_AFTER_COMMA.sub("", expr)
    try:
        value = float(expr)
    except ValueError:
        pass
    else:
        if _is_near_integer(value):
            expr = str(round(value))
    if "\\" in expr:
        # pylatexenc rejects some inputs; slime then keeps the raw string
        with contextlib.suppress(Exception):
            expr = latex_to_plain(expr)
    expr = _SPACES_AFTER_MINUS.sub("-", expr)
    expr = _MIXED_NUMBER.sub(r"\1+\2", expr)  # `7 3/4` -> `7+3/4`
    expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if is_integer_string(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr
