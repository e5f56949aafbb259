"""Rule-based rewards by name: `score(rm_type, response, label, metadata)`.

Owns: the table of rule graders (slime's `deepscaler`, `dapo`, `math`, `f1`, plus `tiny_task`,
the synthetic task of hpc_rl's embedded default run, graded in `hpc_rl.data.tiny_task`, slime's Geometry3K grader
`geo3k` and the tiny visual task's `tiny_vl_task`, `hpc_rl.data.tiny_vl_task`), slime's
`boxed_` prefix (`boxed_f1` grades only the last `\\boxed{}` content of the response), the override
per sample `metadata["rm_type"]` (which wins over the configured type, as in slime), and the error for an
unknown type. Rule graders are synchronous and cheap. `remote_rm` and custom functions are async
and live in `group`; `score` refuses them with a pointer there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hpc_rl.config.sections.rollout import RM_TYPES as CONFIG_RM_TYPES
from hpc_rl.data.tiny_task import tiny_task_reward
from hpc_rl.rewards.boxed_answer import last_boxed_answer
from hpc_rl.rewards.boxed_math import boxed_math_reward
from hpc_rl.rewards.dapo import dapo_reward
from hpc_rl.rewards.deepscaler import deepscaler_reward
from hpc_rl.rewards.f1 import f1_reward
from hpc_rl.rewards.geo3k import geo3k_reward
from hpc_rl.data.tiny_vl_task import tiny_vl_task_reward

RuleGrader = Callable[[str, Any], float]

RULE_GRADERS: Mapping[str, RuleGrader] = {
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "math": boxed_math_reward,
    "f1": f1_reward,
    "tiny_task": tiny_task_reward,
    "geo3k": geo3k_reward,
    "tiny_vl_task": tiny_vl_task_reward,
}
REMOTE_RM = "remote_rm"
RM_TYPES = CONFIG_RM_TYPES  # the config's table (hpc_rl.config.sections.rollout.RmType)
"""Every valid `rm_type`; each rule type may also be prefixed with `boxed_`."""
BOXED_PREFIX = "boxed_"


class UnknownRewardType(ValueError):
    """An `rm_type` that names no grader."""


def resolve_rm_type(rm_type: str | None, metadata: Mapping[str, Any] | None = None) -> str:
    """The rm type that applies to one sample: `metadata["rm_type"]` if set, else `rm_type`."""
    override = metadata.get("rm_type") if metadata else None
    chosen = (override or rm_type or "").strip()
    if not chosen:
        raise UnknownRewardType(
            f"no rm_type given; valid types: {', '.join(RM_TYPES)} (or set custom_rm_path)"
        )
    return chosen


def split_boxed_prefix(rm_type: str) -> tuple[bool, str]:
    """`boxed_f1` -> (True, "f1"); `f1` -> (False, "f1")."""
    if rm_type.startswith(BOXED_PREFIX):
        return True, rm_type[len(BOXED_PREFIX) :]
    return False, rm_type


def check_rm_type(rm_type: str) -> None:
    """Raise UnknownRewardType unless `rm_type` (with or without `boxed_`) names a grader."""
    _, base = split_boxed_prefix(rm_type)
    if base not in RM_TYPES:
        valid = ", ".join(RM_TYPES)
        raise UnknownRewardType(
            f"unknown rm_type {rm_type!r}; valid types: {valid} (rule types also as boxed_<type>), "
            "or use custom_rm_path for your own function"
        )


def score(rm_type: str, response: str, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """The reward of one response under a rule-based grader.

    deepscaler, math: 1.0 / 0.0; dapo: 1.0 / -1.0; f1: token F1 in [0, 1].
    Grader errors (e.g. a non-integer dapo label) propagate; `remote_rm` raises ValueError (it is
    async: use `reward_group`).
    """
    chosen = resolve_rm_type(rm_type, metadata)
    check_rm_type(chosen)
    boxed_only, base = split_boxed_prefix(chosen)
    if base == REMOTE_RM:
        raise ValueError("remote_rm is asynchronous: call hpc_rl.rewards.reward_group with a RewardSpec")
    if not isinstance(response, str):
        raise TypeError(f"response must be a string, got {type(response).__name__}")
    if boxed_only:
        response = last_boxed_answer(response) or ""
    return float(RULE_GRADERS[base](response, label))
