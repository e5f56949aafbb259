"""When the old log-probs need their own forward pass (issue 11: no redundant forward pass)."""

from __future__ import annotations

import pytest

from hpc_rl.config.schema import AlgorithmConfig, TrainingConfig
from hpc_rl.training.step import old_logprobs_need_own_pass


@pytest.mark.parametrize(("steps", "kl_coef", "has_ref", "rollout_logprobs", "own_pass"), [
    (1, 0.0, False, False, False),   # the default GRPO run: the training pass's log-probs are the old ones
    (1, 0.0, True, False, False),    # KL loss against a reference: the loss needs only ref log-probs first
    (2, 0.0, False, False, True),    # the second step runs after an update: old != current
    (1, 0.05, True, False, True),    # KL reward shaping: the advantages need old log-probs before the loss
    (1, 0.05, False, False, False),  # no reference: no KL to shape with
    (2, 0.0, False, True, False),    # the engine's log-probs are the old ones
])
def test_own_pass_only_when_needed(steps: int, kl_coef: float, has_ref: bool, rollout_logprobs: bool,
                                   own_pass: bool) -> None:
    training = TrainingConfig(num_steps_per_rollout=steps, global_batch_size=8)
    algorithm = AlgorithmConfig(kl_coef=kl_coef, use_rollout_logprobs=rollout_logprobs)
    assert old_logprobs_need_own_pass(training, algorithm, has_ref=has_ref) is own_pass
