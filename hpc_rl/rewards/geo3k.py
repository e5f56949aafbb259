"""The `geo3k` reward (slime's Geometry3K grader for its Qwen3-VL recipe): 1 if the response's last `\\boxed{}`
equals the label under sympy, numbers within 0.05 of each other counting as equal, else 0.

Owns: the answer extraction (the last `\\boxed{}` of the whole response; none: 0) and the tolerance. Why a
tolerance: Geometry3K's labels are often rounded (8/15 stored as 0.53), so an exact answer would score 0; slime's
`rm_hub/geo3k.py` (THUDM/slime before 20cabd5c, 2025-12-03) compared with `grade_answer_sympy(answer, label,
tol=0.05)`, without the mathd string check first. Equality is `math_equivalence.equal_under_sympy`: an integer label
still needs an integer answer, and two fractions must match as written (no tolerance between them).
"""

from __future__ import annotations

from typing import Any

from hpc_rl.rewards.boxed_answer import last_boxed_answer
from hpc_rl.rewards.math_equivalence import equal_under_sympy

GEO3K_TOLERANCE = 0.05


def geo3k_reward(response: str, label: Any) -> float:
    """1.0 if the last `\\boxed{...}` of `response` equals `label` within GEO3K_TOLERANCE, else 0.0."""
    answer = last_boxed_answer(response)
    if answer is None or label is None:
        return 0.0
    return 1.0 if equal_under_sympy(answer, str(label), tol=GEO3K_TOLERANCE) else 0.0
