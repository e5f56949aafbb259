"""Colocated weight pushes from a pipeline-parallel trainer (issue 19, slime's colocated PP 4 GLM-4.5 line), real
processes: two torchrun ranks at PP 2 (each holds one layer of the tiny Qwen3), each sharing its device with a CPU
engine of its own. Every engine needs the whole model, so each stage's parameters reach the other stage over the
pipeline group before every bucket is handed over; the engines then serve exactly the trainer's weights after
every sync (log-probs equal), the engine fed by stage 1 included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.run_helpers import placement, processes_mentioning, records, run_to_end

pytestmark = pytest.mark.slow


def test_colocated_pp2_engines_serve_the_trainers_weights_after_every_sync(tmp_path: Path) -> None:
    run_dir = tmp_path / "pp2"
    result = run_to_end(run_dir, "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                        "--pipeline-model-parallel-size", "2", "--num-rollout", "3", "--eval-interval", "100",
                        timeout_s=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trainers, engines, _ = placement(run_dir)
    assert len(trainers) == 2 and len(engines) == 2  # rank r (stage r) feeds the engine on its device
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:  # the first sync (v0, before rollout 0) and each later one: both engines hold every layer
        metrics = row["metrics"]
        assert metrics["train/first_step_train_rollout_logprob_abs_diff"] < 1e-5, (row["rollout_id"], metrics)
    assert "colocated engine(s) through /update_weights_from_tensor" in (run_dir / "logs" / "controller.log").read_text()
    assert processes_mentioning(str(run_dir)) == []
