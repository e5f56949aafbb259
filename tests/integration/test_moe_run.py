"""The tiny mixture-of-experts run on this machine: `python -m hpc_rl.submit configs/tiny_moe_cpu.yaml`.

Real processes: controller, sglang-router, a CPU engine serving transformers' Qwen3MoeForCausalLM, and two
torchrun trainer ranks at expert parallelism 2 (Megatron's alltoall dispatcher over gloo; each rank holds
2 of the 4 experts of every layer, the decoupled weight sync gathers them across EP). The run must learn
the tiny task as the dense default does, and the engine's log-probs must equal the trainer's at the first
step and after every sync (float32 on both sides: any expert that missed its sync would show).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.run_helpers import (
    REPO_ROOT, processes_mentioning, records, run_tiny_recipe_to_learning, submit_argv,
)

pytestmark = pytest.mark.slow


def test_tiny_moe_run_learns_and_engine_logprobs_equal_the_trainers(tmp_path: Path) -> None:
    run_dir = tmp_path / "moe"
    rows = run_tiny_recipe_to_learning(run_dir, "configs/tiny_moe_cpu.yaml", "--eval-interval", "50")
    assert all(row["metrics"]["train/samples"] == 128.0 for row in rows)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "Traceback" not in trainer_log
    assert processes_mentioning(str(run_dir)) == []


def test_colocated_moe_run_serves_every_expert_to_both_engines(tmp_path: Path) -> None:
    """Colocated at EP2: each trainer rank hands the whole model (its experts and, gathered over EP, the other
    rank's) to the engine on its device through /update_weights_from_tensor; both engines then compute the
    trainer's log-probs."""
    run_dir = tmp_path / "colocated"
    result = subprocess.run(submit_argv(run_dir, "--colocate", "--rollout-num-gpus", "2", "--num-rollout", "3",
                                        "--eval-interval", "100", config="configs/tiny_moe_cpu.yaml"),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["metrics"]["train/train_rollout_logprob_abs_diff"] < 1e-4, (row["rollout_id"], row["metrics"])
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    # one before rollout 0 (the engines freed the GPUs for the trainer's start), then one after each step
    assert controller_log.count("2 colocated engine(s) through /update_weights_from_tensor") == 4
    assert processes_mentioning(str(run_dir)) == []
