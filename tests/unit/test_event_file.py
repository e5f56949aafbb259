"""The torch-free TensorBoard event writer: TensorBoard's own reader gets back every scalar."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.telemetry.event_file import crc32c
from hpc_rl.telemetry.scalars import ScalarLog


def test_crc32c_known_answer() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0


def test_tensorboard_reads_every_scalar_back(tmp_path) -> None:
    accumulator_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log = ScalarLog(tmp_path, filename_suffix=".controller")
    log.log({"rollout/reward_mean": 0.25, "time/step": 1.5, "flag": True, "bad": float("nan")}, step=0)
    log.log({"rollout/reward_mean": -0.75}, step=300)
    log.close()
    (event_file,) = tmp_path.iterdir()
    assert event_file.name.startswith("events.out.tfevents.") and event_file.name.endswith(".controller")
    accumulator = accumulator_module.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["scalars"]) == ["rollout/reward_mean", "time/step"]
    rewards = accumulator.Scalars("rollout/reward_mean")
    assert [(e.step, e.value) for e in rewards] == [(0, 0.25), (300, -0.75)]
    assert [(e.step, e.value) for e in accumulator.Scalars("time/step")] == [(0, 1.5)]


def test_the_controller_leaves_train_scalars_to_the_trainer(tmp_path) -> None:
    """Trainer rank 0 writes train/* per optimizer step; the controller's per-rollout summary of the same tags
    would be a second series on another step axis in the same TensorBoard dir."""
    accumulator_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from hpc_rl.config import load_config

    config = load_config([str(Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml")], [])
    log = ScalarLog.for_controller(tmp_path, config, run_dir=tmp_path)
    log.log({"rollout/reward_mean": 0.5, "train/pg_loss": 0.1}, step=1)
    log.close()
    accumulator = accumulator_module.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert accumulator.Tags()["scalars"] == ["rollout/reward_mean"]
