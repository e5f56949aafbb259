"""Rollout service: engine client, generation, dynamic sampling, partial buffer, eval rollouts.

Entry points for the controller: `EngineClient` (+ an `EngineDirectory`), `RolloutScheduler.run`,
`run_eval`. See each module's docstring for what it owns.
"""

from hpc_rl.rollout.engine_client import EngineClient, EngineDirectory, StaticEngineDirectory
from hpc_rl.rollout.eval import eval_metrics, load_eval_datasets, run_eval
from hpc_rl.rollout.filters import FilterResult, check_reward_nonzero_std, pop_first
from hpc_rl.rollout.generate import (
                                     GenerationSession,
                                     RetryPolicy,
                                     append_tool_tokens,
                                     current_session,
                                     eval_sampling_params,
                                     generate_turn,
                                     load_generate_function,
                                     rollout_sampling_params,
)
from hpc_rl.rollout.partial_buffer import PartialRolloutBuffer, mask_offpolicy, violates_staleness
from hpc_rl.rollout.scheduler import RewardFn, RolloutResult, RolloutScheduler, SchedulerSettings

__all__ = [
                                     "EngineClient",
                                     "EngineDirectory",
                                     "FilterResult",
                                     "GenerationSession",
                                     "PartialRolloutBuffer",
                                     "RetryPolicy",
                                     "RewardFn",
                                     "RolloutResult",
                                     "RolloutScheduler",
                                     "SchedulerSettings",
                                     "StaticEngineDirectory",
                                     "append_tool_tokens",
                                     "check_reward_nonzero_std",
                                     "current_session",
                                     "eval_metrics",
                                     "eval_sampling_params",
                                     "generate_turn",
                                     "load_eval_datasets",
                                     "load_generate_function",
                                     "mask_offpolicy",
                                     "pop_first",
                                     "rollout_sampling_params",
                                     "run_eval",
                                     "violates_staleness",
]
