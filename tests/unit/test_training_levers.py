"""Trainer speed levers (issue 11): when the old log-probs need their own forward pass, and the
micro-batch layout `auto` picks by shape."""

from __future__ import annotations

import pytest

from hpc_rl.config.sections.algorithm import AlgorithmConfig
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.training.micro_batches import choose_qkv_format
from hpc_rl.training.step_settings import old_logprobs_need_own_pass


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


def test_auto_layout_by_shape() -> None:
    tiny_run = [11, 10, 11, 9] * 32  # 7 prompt + <= 4 response tokens (configs/tiny_cpu.yaml)
    assert choose_qkv_format("auto", tiny_run, on_cpu=True) == "bshd"
    assert choose_qkv_format("auto", [400, 12, 9, 30], on_cpu=True) == "thd"  # padding would be 3.5x the tokens
    assert choose_qkv_format("auto", [128, 256] * 8, on_cpu=True) == "thd"  # 3072 tokens: per-sequence attention
    assert choose_qkv_format("auto", tiny_run, on_cpu=False) == "thd"  # TE's THD kernels on GPU
    assert choose_qkv_format("auto", tiny_run, on_cpu=True, cp_size=2) == "thd"  # CP splits packed rows
    assert choose_qkv_format("thd", tiny_run, on_cpu=True) == "thd"  # an explicit choice stands
    assert choose_qkv_format("bshd", [400, 12], on_cpu=True) == "bshd"


def test_auto_is_the_default_and_refused_nowhere() -> None:
    assert TrainingConfig().qkv_format == "auto"
    with pytest.raises(ValueError, match="thd|bshd|auto"):
        TrainingConfig(qkv_format="sbhd")
