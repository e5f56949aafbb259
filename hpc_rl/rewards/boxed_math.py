"""The `math` reward: 1 if the last `\\boxed{}` of the whole response equals the label, else 0.

Owns: the answer extraction for `--rm-type math` (the whole response, `</think>` is not special)
and slime's label handling (an empty or falsy label such as `0` never scores, a `\\boxed{}` label
is unwrapped). Equality is `math_equivalence.answers_match`. Mirrors slime's `grade_answer_verl`.
Named `boxed_math` so that nothing in this package shadows the standard library's `math`.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.rewards.boxed_answer import BOXED, last_boxed_answer
from hpc_rl.rewards.math_equivalence import answers_match


def boxed_math_reward(response: str, label: Any) -> float:
    """1.0 if the response's last `\\boxed{...}` matches `label`, else 0.0."""
    if not label:
        return 0.0  # slime: `if not ground_truth` -- so a label of 0 never scores either
    truth: str | None = str(label)
    if BOXED in str(label):
        truth = last_boxed_answer(str(label))  # None (nothing matches) when the box is malformed
    answer = last_boxed_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, truth) else 0.0
