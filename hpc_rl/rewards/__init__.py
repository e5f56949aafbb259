"""Rewards: slime's rule graders (deepscaler, dapo, math, f1), remote_rm and custom functions.

Public API:
    score(rm_type, response, label, metadata=None) -> float        rule graders, synchronous
    await reward_group(spec: RewardSpec, samples) -> list[float]   what the controller calls
    RewardSpec, RewardError, RM_TYPES, load_reward_function, PluginError
    python -m hpc_rl.rewards --rm-type T --input in.jsonl --output out.jsonl

Modules, one concern each: boxed_answer (last `\\boxed{}`), math_normalize (answer strings),
math_equivalence (mathd + sympy equality), deepscaler, boxed_math (`math`), dapo, f1, remote
(POST with retries), plugins (custom_rm_path), scoring (rule dispatch), group (async entry).
Grades match slime's `rm_hub` on the same (response, label) pairs; tests pin the cases.
"""

from hpc_rl.rewards.dapo import DapoResult, dapo_grade
from hpc_rl.rewards.group import RewardError, RewardSpec, reward_group
from hpc_rl.rewards.plugins import PluginError, load_reward_function
from hpc_rl.retry_policy import RetryPolicy
from hpc_rl.rewards.remote import REMOTE_RM_RETRY, RemoteRewardError
from hpc_rl.rewards.scoring import RM_TYPES, UnknownRewardType, check_rm_type, score

__all__ = [
    "RM_TYPES",
    "DapoResult",
    "PluginError",
    "RemoteRewardError",
    "REMOTE_RM_RETRY",
    "RetryPolicy",
    "RewardError",
    "RewardSpec",
    "UnknownRewardType",
    "check_rm_type",
    "dapo_grade",
    "load_reward_function",
    "reward_group",
    "score",
]
