"""The tiny mixture-of-experts run on this machine: `python -m hpc_rl.submit configs/tiny_moe_cpu.yaml`.

Real processes: controller, sglang-router, a CPU engine serving transformers' Qwen3MoeForCausalLM, and two
torchrun trainer ranks at expert parallelism 2 (Megatron's alltoall dispatcher over gloo; each rank holds
2 of the 4 experts of every layer, the decoupled weight sync gathers them across EP). Over a few rollouts the
engine's log-probs must equal the trainer's at the first step and after every sync (float32 on both sides: any
expert that missed its sync would show). That GRPO learns is shown once, by the dense default's 100-rollout run
(test_run_local.py::test_tiny_default_run_learns): the family changes what is synced, not what learning shows.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.run_helpers import (
    REPO_ROOT, SHORT_RUN_ROLLOUTS, processes_mentioning, records, run_tiny_recipe_in_sync, submit_argv,
)
from tests.integration.test_run_local import tensorboard_scalars

pytestmark = pytest.mark.slow


def test_tiny_moe_run_engine_logprobs_equal_the_trainers_after_every_sync(tmp_path: Path) -> None:
    """Three rollouts at EP 2 (learning: test_run_local.py::test_tiny_default_run_learns)."""
    run_dir = tmp_path / "moe"
    rows = run_tiny_recipe_in_sync(run_dir, "configs/tiny_moe_cpu.yaml", "--eval-interval", str(SHORT_RUN_ROLLOUTS))
    assert all(row["metrics"]["train/samples"] == 128.0 for row in rows)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "Traceback" not in trainer_log
    assert processes_mentioning(str(run_dir)) == []


def test_colocated_moe_run_serves_every_expert_to_both_engines_and_replays_their_routing(tmp_path: Path) -> None:
    """Colocated at EP2: each trainer rank hands the whole model (its experts and, gathered over EP, the other
    rank's) to the engine on its device through /update_weights_from_tensor; both engines then compute the
    trainer's log-probs. With rollout routing replay (engines started with --enable-return-routed-experts),
    every token's routing travels from the engine that generated it to the trainer, whose routers use it for
    every token; router health reaches TensorBoard."""
    run_dir = tmp_path / "colocated"
    result = subprocess.run(submit_argv(run_dir, "--colocate", "--rollout-num-gpus", "2", "--num-rollout", "3",
                                        "--use-rollout-routing-replay", "--moe-aux-loss-coeff", "0.01",
                                        "--eval-interval", "100", config="configs/tiny_moe_cpu.yaml"),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        metrics = row["metrics"]
        assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-4, (row["rollout_id"], metrics)
        # the routing each MoE layer used is the engine's, for every token the engine ran (reported only
        # while replaying: a run without the replay fails here)
        assert metrics["moe/replayed_routing_agreement"] == 1.0, metrics
        # at the weights the engine served (on-policy), the trainer's own routers agree with the engine's
        # choice: every record reached its own token
        assert metrics["moe/routing_agreement"] >= 0.99, metrics
        for layer in (0, 1):
            assert 1.0 <= metrics[f"moe/max_over_mean_load/layer_{layer}"] <= 2.0  # 4 experts, top-2
        assert metrics["moe/load_balancing_loss"] > 0
    for tag in ("train/moe/max_over_mean_load", "train/moe/routing_agreement", "train/moe/load_balancing_loss",
                "moe/routing_agreement"):  # the trainer's per step, the controller's per rollout
        assert len(tensorboard_scalars(run_dir, tag)) == 3, tag
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    # one before rollout 0 (the engines freed the GPUs for the trainer's start), then one after each step
    assert controller_log.count("2 colocated engine(s) through /update_weights_from_tensor") == 4
    for engine_log in (run_dir / "logs").glob("engine-*.log"):
        assert "Traceback" not in engine_log.read_text(), engine_log
    assert processes_mentioning(str(run_dir)) == []
