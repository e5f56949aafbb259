"""The `dapo` reward (DAPO-Math): +1.0 if the last `Answer: X` matches the integer label, else -1.0.

Owns: the 300-character window at the end of the response, the last `Answer: X` in it (any case,
whitespace around the colon, `X` up to the end of its line), the Minerva-style normalisation of X
and of the label, and the integer comparison (DAPO-Math labels are integers: the normalised label
goes through `int(float(.))`). Mirrors slime's `rm_hub/math_dapo_utils.py` without strict-box mode.
A label that is not a number raises ValueError (slime raises too): a data problem, not a 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

WINDOW_CHARS = 300
"""Only the end of the response is read (the longest MATH-500 answer has 159 characters)."""
NO_ANSWER = "[INVALID]"

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Applied in order with str.replace. The list is part of the grading contract: reordering it
# changes rewards (e.g. "an " is dropped before spaces are).
_REPLACEMENTS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DELETIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
)  # fmt: skip
_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep only the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrt2 -> \sqrt{2}
)


@dataclass(frozen=True)
class DapoResult:
    score: float
    """1.0 when correct, -1.0 otherwise (what slime's `--reward-key score` reads)."""
    acc: bool
    """Whether the prediction matched."""
    pred: str
    """The normalised prediction (`[INVALID]` when there was no `Answer:`)."""


def normalize_final_answer(answer: Any) -> str:
    """Minerva-style normalisation: text after the last `=`, units and LaTeX wrappers removed."""
    text = str(answer).split("=")[-1]
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    for junk in _DELETIONS:
        text = text.replace(junk, "")
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_answer(response: str) -> str:
    """The raw X of the last `Answer: X` in the final 300 characters, or `[INVALID]`."""
    found = _ANSWER_LINE.findall(response[-WINDOW_CHARS:])
    return found[-1] if found else NO_ANSWER


def integer_label(label: Any) -> str:
    """The label as the integer string predictions are compared with (`"34"`, `34.0` -> `"34"`)."""
    normalized = normalize_final_answer(label)
    try:
        return str(int(float(normalized)))
    except (ValueError, OverflowError) as error:
        raise ValueError(
            f"dapo compares against integer labels; label {label!r} normalises to {normalized!r}, "
            "which is not a finite number (use rm_type math or deepscaler for non-integer answers)"
        ) from error


def dapo_grade(response: str, label: Any) -> DapoResult:
    """Score, accuracy and normalised prediction for one response."""
    truth = integer_label(label)
    pred = normalize_final_answer(extract_answer(response))
    correct = pred == truth
    return DapoResult(score=1.0 if correct else -1.0, acc=correct, pred=pred)


def dapo_reward(response: str, label: Any) -> float:
    return dapo_grade(response, label).score
