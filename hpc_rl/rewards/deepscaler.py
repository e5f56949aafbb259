"""The `deepscaler` reward: 1 if the boxed answer after the reasoning equals the label, else 0.

Owns: which part of a response is graded (after the last `</think>`; else the part after the first
`###Response`; else nothing, score 0), the label's own `\\boxed{}` unwrapping, and the 0/1 result.
Equality itself is `math_equivalence.answers_match`. Mirrors slime's `rm_hub/deepscaler.py`.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.rewards.boxed_answer import BOXED, last_boxed_answer
from hpc_rl.rewards.math_equivalence import answers_match

THINK_END = "</think>"
RESPONSE_MARKER = "###Response"


def graded_part(response: str) -> str | None:
    """The text deepscaler grades, or None when the response never finished thinking."""
    if THINK_END in response:
        return response.split(THINK_END)[-1]
    if RESPONSE_MARKER in response:
        return response.split(RESPONSE_MARKER)[1]
    return None


def deepscaler_reward(response: str, label: Any) -> float:
    """1.0 if the last `\\boxed{}` after `</think>` matches `label` (mathd or sympy), else 0.0.

    Raises TypeError for a label that is not a str, int or float (slime asserts the same), but only
    once there is an answer to compare: a response without one scores 0 whatever the label.
    """
    if not response:
        return 0.0
    solution = graded_part(response)
    if solution is None:
        return 0.0
    answer = last_boxed_answer(solution)
    if answer is None or label == "":
        return 0.0
    if not isinstance(label, (str, int, float)):
        raise TypeError(f"deepscaler needs a str/int/float label, got {type(label).__name__}: {label!r}")
    truth = str(label)
    if BOXED in truth:
        unwrapped = last_boxed_answer(truth)
        if unwrapped is None:
            return 0.0  # a label like `\boxed 5` leaves nothing to compare with
        truth = unwrapped
    return 1.0 if answers_match(answer, truth) else 0.0
