"""Rule graders agree with slime's on concrete (response, label) pairs.

`data/rewards_cases.jsonl` holds cases whose expected rewards were derived from slime's
rm_hub logic (deepscaler.py, math_utils.py, math_dapo_utils.py, f1.py); each says why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rl.rewards import dapo_grade, score
from hpc_rl.rewards.boxed_answer import last_boxed_answer
from hpc_rl.rewards.math_equivalence import answers_match, equal_under_sympy, split_tuple
from hpc_rl.rewards.math_normalize import normalize_for_sympy, normalize_mathd

CASES = [
    json.loads(line)
    for line in (Path(__file__).parent / "data" / "rewards_cases.jsonl").read_text().splitlines()
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['rm_type']}:{c['why']}" for c in CASES])
def test_case_file(case: dict) -> None:
    assert score(case["rm_type"], case["response"], case["label"]) == pytest.approx(
        case["expected"], abs=1e-6
    )


def test_case_file_covers_every_rule_type() -> None:
    assert {c["rm_type"] for c in CASES} == {"deepscaler", "math", "dapo", "f1"}


# --- boxed extraction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("a \\boxed{1} b \\boxed{2} c", "2"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed{}", ""),
        ("\\boxed 5", None),
        ("\\boxed{5", None),
        ("\\fbox{5}", None),
        ("no box", None),
    ],
)
def test_last_boxed_answer(text: str, expected: str | None) -> None:
    assert last_boxed_answer(text) == expected


# --- normalisation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\frac1{72}", "\\frac{1}{72}"),
        ("0.5", "\\frac{1}{2}"),
        (".5", "\\frac{1}{2}"),
        ("3/4", "\\frac{3}{4}"),
        ("\\left( 1, 2 \\right]", "(1,2]"),
        ("k = 5", "5"),
        ("abc = 5", "abc=5"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("10 \\text{ cm}", "10"),
        ("\\text{Monday}", "Monday"),
        ("90^\\circ", "90"),
        ("50\\%", "50"),
        ("\\frac", "\\frac"),  # malformed: slime gives the input back
        ("1 \\text{ a} \\text{ b}", "1 \\text{ a} \\text{ b}"),  # two units: input back
        (None, None),
    ],
)
def test_normalize_mathd(raw: str | None, expected: str | None) -> None:
    assert normalize_mathd(raw) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("\\frac{1}{2}", "1/2"),
        ("\\text{Monday}", "mon"),  # slime drops unit words anywhere: "day" is a unit
        ("5 \\text{cm}", "5"),
        ("1,000", "1000"),
        ("34.0", "34"),
        ("- 3", "-3"),
        ("7 3/4", "7+3/4"),
        ("\\pi", "pi"),
        ("{5}", "5"),
        ("2 or 3", "2,3"),
        ("", ""),
    ],
)
def test_normalize_for_sympy(raw: str, expected: str) -> None:
    assert normalize_for_sympy(raw) == expected


# --- equivalence --------------------------------------------------------------------------------


def test_split_tuple() -> None:
    assert split_tuple("(1,2]") == ["1", "2"]
    assert split_tuple("(1,000,2)") == ["1000", "2"]
    assert split_tuple("((1,2),3)") == ["((1,2),3)"]
    assert split_tuple("") == []


@pytest.mark.parametrize(
    ("given", "truth", "expected"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("1/2", "\\frac{1}{2}", True),
        ("2/4", "1/2", False),  # unreduced fractions are not accepted
        ("4/2", "2", False),  # an integer label needs an integer answer
        ("(1, 2]", "(1,2]", True),
        ("[1, 2]", "(1,2]", False),
        ("(1, 2, 3)", "(1,2)", False),
        ("\\sqrt{12}", "2\\sqrt{3}", True),
        ("x^2+2x+1", "(x+1)^2", True),
        ("a+b+c", "c+b+a", False),  # three letters: sympy is not tried, strings differ
        ("2^{10}", "1024", False),  # `^{` is never given to sympy
    ],
)
def test_answers_match(given: str, truth: str, expected: bool) -> None:
    assert answers_match(given, truth) is expected


def test_equal_under_sympy_none() -> None:
    assert equal_under_sympy(None, "1") is False
    assert equal_under_sympy("1", None) is False


# --- dapo details -------------------------------------------------------------------------------


def test_dapo_grade_reports_pred_and_acc() -> None:
    result = dapo_grade("blah\nAnswer: $1,000$ dollars", "1000")
    assert (result.score, result.acc, result.pred) == (1.0, True, "1000")
    missing = dapo_grade("I do not know", "7")
    assert (missing.score, missing.acc, missing.pred) == (-1.0, False, "[INVALID]")


def test_dapo_window_is_exactly_300_characters() -> None:
    answer = "Answer: 34"
    inside = answer + "\n" + "x" * (299 - len(answer))
    outside = answer + "\n" + "x" * (300 - len(answer))
    assert (len(inside), len(outside)) == (300, 301)
    assert score("dapo", inside, "34") == 1.0
    assert score("dapo", outside, "34") == -1.0


def test_dapo_non_integer_label_is_an_error() -> None:
    with pytest.raises(ValueError, match="integer labels"):
        score("dapo", "Answer: 1/2", "\\frac{1}{2}")


# --- dispatch -----------------------------------------------------------------------------------


def test_boxed_prefix_grades_only_the_boxed_content() -> None:
    assert score("boxed_f1", "blah blah \\boxed{Paris}", "Paris") == 1.0
    assert score("f1", "blah blah \\boxed{Paris}", "Paris") < 1.0
    assert score("boxed_f1", "no box", "Paris") == 0.0


def test_metadata_rm_type_overrides() -> None:
    assert score("math", "Answer: 34", "34", metadata={"rm_type": "dapo"}) == 1.0
    assert score("math", "Answer: 34", "34", metadata={}) == 0.0


def test_unknown_rm_type_lists_valid_ones() -> None:
    with pytest.raises(
        ValueError, match="unknown rm_type 'mth'.*deepscaler, dapo, math, f1, remote_rm, tiny_task"
    ):
        score("mth", "x", "y")


def test_remote_rm_is_not_sync() -> None:
    with pytest.raises(ValueError, match="reward_group"):
        score("remote_rm", "x", "y")


def test_bad_labels_raise() -> None:
    with pytest.raises(TypeError, match="deepscaler needs a str/int/float label"):
        score("deepscaler", "</think>\\boxed{1}", ["1"])
    with pytest.raises(TypeError, match="f1 needs a string label"):
        score("f1", "x", 3)


def test_tiny_task_is_a_rule_type() -> None:
    assert score("tiny_task", "it is 7, then 3", "7") == 1.0
    assert score("tiny_task", "no digits", "7") == 0.0


def test_integer_answers_are_compared_without_sympy(monkeypatch):
    """Two plain integers are equal or not without a sympy call (~6 ms each on the controller's loop)."""
    from hpc_rl.rewards import math_equivalence

    def no_sympy(*args, **kwargs):
        raise AssertionError("sympy called for two plain integers")

    monkeypatch.setattr(math_equivalence, "sympy_difference_is_zero", no_sympy)
    assert not math_equivalence.answers_match("0", "1")
    assert not math_equivalence.answers_match("-12", "12")
    assert math_equivalence.answers_match("0042", "42")
