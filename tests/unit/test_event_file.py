"""The torch-free TensorBoard event writer: TensorBoard's own reader gets back every scalar."""

from __future__ import annotations

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
