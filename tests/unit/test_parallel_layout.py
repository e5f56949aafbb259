"""The trainer's parallel layout has one home (`hpc_rl.config.parallel_layout.ParallelLayout`): validation's
divisibility rules, the memory plan and the trainer's `ParallelInfo` sizes are made from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.parallel_layout import ParallelLayout, dense_layout_problems
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.training.parallel import layout_sizes
from tests.unit.config_problems import codes, config_problems, message_of


def test_layout_sizes_follow_megatrons_grouping() -> None:
    training = TrainingConfig(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                              expert_model_parallel_size=2)
    layout = ParallelLayout.of(training, 16)
    assert (layout.model_parallel, layout.dp, layout.expert_dp) == (4, 4, 4)  # CP folds into expert-DP
    assert layout_sizes(layout) == {"tp_size": 2, "dp_size": 4, "pp_size": 1, "cp_size": 2, "ep_size": 2,
                                    "expert_tp_size": 2}
    assert ParallelLayout.of(training, 6).dp == 0  # TP x CP = 4 does not divide 6


def test_dense_layout_rules_name_the_numbers() -> None:
    layout = ParallelLayout.of(TrainingConfig(pipeline_model_parallel_size=2), 3)
    (problem,) = dense_layout_problems(layout, 64)
    assert (problem.field, problem.code) == ("training.tensor_model_parallel_size", "not_divisible")
    assert "TP*PP*CP = 1*2*1 = 2 does not divide the trainer's 3 GPUs" in problem.message
    (problem,) = dense_layout_problems(ParallelLayout.of(TrainingConfig(), 3), 64)
    assert (problem.field, problem.code, problem.message) == (
        "training.global_batch_size", "not_divisible", "64 is not divisible by the data-parallel size 3")
    assert dense_layout_problems(ParallelLayout.of(TrainingConfig(), 4), 64) == []


def test_validation_reports_the_layouts_rules(in_repo: Path) -> None:
    found = config_problems(["configs/tiny_cpu.yaml"], ["--actor-num-gpus-per-node", "3", "--global-batch-size",
                                                        "64", "--rollout-batch-size", "8"])
    assert ("training.global_batch_size", "not_divisible") in codes(found)
    assert "the data-parallel size 3" in message_of(found, "training.global_batch_size")
    run = load_config(["configs/tiny_cpu.yaml"], ["--actor-num-gpus-per-node", "4"])
    assert ParallelLayout.of_run(run) == ParallelLayout.of(run.training, 4)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_a_dense_model_is_data_parallel_over_the_rest(world: int) -> None:
    assert ParallelLayout.of(TrainingConfig(), world).dp == world
