"""Rollout routing replay in a real run (`configs/tiny_moe_cpu.yaml`: controller, sglang-router, a CPU engine
started with --enable-return-routed-experts, two torchrun ranks at EP2): every token's routing travels from
the engine to the trainer, whose routers use it for every token, and router health reaches TensorBoard."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.run_helpers import REPO_ROOT, processes_mentioning, records, submit_argv
from tests.integration.test_run_local import tensorboard_scalars

pytestmark = pytest.mark.slow


def test_trainer_routes_every_token_as_the_engine_did(tmp_path: Path) -> None:
    run_dir = tmp_path / "r3"
    argv = submit_argv(run_dir, "--use-rollout-routing-replay", "--num-rollout", "2", "--rollout-batch-size", "4",
                       "--global-batch-size", "32", "--micro-batch-size", "16", "--moe-aux-loss-coeff", "0.01",
                       "--eval-interval", "100", "--skip-eval-before-train", config="configs/tiny_moe_cpu.yaml")
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = records(run_dir)
    assert [row["rollout_id"] for row in rows] == [0, 1]
    for row in rows:
        metrics = row["metrics"]
        # the routing each MoE layer used is the engine's, for every token the engine ran
        assert metrics["moe/replayed_routing_agreement"] == 1.0
        # at the weights the engine served (sync: on-policy), the trainer's own routers agree with it, so the
        # record reached its own token, and with the engine's routing the log-probs are the engine's
        assert metrics["moe/routing_agreement"] >= 0.99
        assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
        for layer in (0, 1):
            assert 1.0 <= metrics[f"moe/max_over_mean_load/layer_{layer}"] <= 2.0  # 4 experts, top-2
        assert metrics["moe/load_balancing_loss"] > 0
    for tag in ("train/moe/max_over_mean_load", "train/moe/routing_agreement", "train/moe/load_balancing_loss",
                "moe/routing_agreement"):
        assert len(tensorboard_scalars(run_dir, tag)) == 2, tag
    engine_log = next((run_dir / "logs").glob("engine-*.log")).read_text()
    assert "Traceback" not in engine_log
    assert processes_mentioning(str(run_dir)) == []
