"""A real local run from a slime-style launch line alone (Megatron model flags, no YAML file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.config.model import ModelArchitecture
from tests.integration.run_helpers import REPO_ROOT, records
from tests.unit.slime_lines import flags_of

pytestmark = pytest.mark.slow


def test_flags_only_run_trains_with_the_flag_architecture(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hpc_rl.submit", *flags_of("tiny_qwen3_model_args.txt"),
            *flags_of("tiny_cpu_rest.txt"), "--executor", "local", "--run-dir", str(run_dir)]
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(records(run_dir)) == 2
    arch = ModelArchitecture.from_yaml(run_dir / "model.yaml")
    assert (arch.num_layers, arch.hidden_size, arch.family) == (2, 64, "qwen3")


def test_use_wandb_run_goes_offline_without_network_and_logs_every_rollout(tmp_path: Path) -> None:
    """slime's WANDB_ARGS on a real local run: no --wandb-mode and a W&B host nobody answers (a node without
    network) -> an offline W&B run in <run_dir>/wandb with one row per rollout, equal to rollouts.jsonl."""
    pytest.importorskip("wandb", reason="pip install -e '.[wandb]' to run the real W&B test")
    from tests.unit.test_wandb_logging import closed_port, wandb_history

    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hpc_rl.submit", *flags_of("tiny_qwen3_model_args.txt"),
            *flags_of("tiny_cpu_rest.txt"), "--use-wandb", "--wandb-project", "slime-dev",
            "--wandb-group", "tiny", "--wandb-host", f"http://127.0.0.1:{closed_port()}",
            "--executor", "local", "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert "offline" in controller_log and "wandb sync" in controller_log
    (run_file,) = (run_dir / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    history, _ = wandb_history(run_file)
    rollouts = records(run_dir)
    assert [row["rollout/step"] for row in history] == [r["rollout_id"] + 1 for r in rollouts] == [1, 2]
    for row, rollout in zip(history, rollouts):
        assert row["rollout/reward_mean"] == pytest.approx(rollout["metrics"]["rollout/reward_mean"])
        assert "train/pg_loss" in row and "time/train" in row
