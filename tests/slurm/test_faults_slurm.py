"""Faults during a run on the local Slurm cluster: each one is recovered from, losing nothing, leaving nothing.

Scenarios and measurements live in `fault_runs.py` (shared with benchmarks/bench_faults.py, which also
runs the variants without restarts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.run_helpers import records
from tests.slurm.fault_runs import kill_controller, kill_engine_node, kill_trainer_rank, two_jobs_and_a_port_squatter

pytestmark = pytest.mark.slurm


def driver_stderr(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.err"))


def test_trainer_rank_killed_restarts_from_the_checkpoint(run_dir: Path) -> None:
    outcome = kill_trainer_rank(run_dir, rank=1, max_restarts=1, num_rollout=5, after_rollouts=2)
    assert outcome.exit_code == 0, outcome.output[-3000:]
    assert outcome.rollout_ids == list(range(5)), "each rollout once, in order (a checkpoint precedes each record)"
    assert (outcome.samples_lost, outcome.samples_duplicated) == (0, 0)
    assert outcome.left_behind == []
    log = driver_stderr(run_dir)
    assert outcome.fault_node in ("node1", "node2")
    assert f"trainer rank 1 (on {outcome.fault_node}) was killed by signal 9 (SIGKILL)" in log, log[-3000:]
    assert "restarting from the last checkpoint (restart 1 of 1)" in log
    assert "resuming at rollout" in (run_dir / "logs" / "controller.log").read_text()
    status = (run_dir / "status.json").read_text()
    assert '"restarts"' in status and "killed by signal 9" in status, status


def test_controller_killed_the_job_is_requeued_and_resumes(run_dir: Path) -> None:
    """Killed after rollout 2's checkpoint committed and before its record was written (the fault hook: every
    time, not one run in a few); the resumed job writes that record from the checkpoint (issue 37, case 7:
    rollouts.jsonl held [0, 1, 3, 4])."""
    outcome = kill_controller(run_dir, max_restarts=1, num_rollout=5, after_rollouts=2)
    assert outcome.exit_code == 0, outcome.output[-3000:]
    assert outcome.rollout_ids == list(range(5))
    assert [r.get("recovered_from_checkpoint", False) for r in records(run_dir)] == [False, False, True, False, False]
    assert (outcome.samples_lost, outcome.samples_duplicated) == (0, 0)
    assert outcome.left_behind == []
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert "the driver (controller) was killed by SIGKILL; requeuing job" in controller_log
    assert "resuming at rollout" in controller_log


def test_two_jobs_share_the_nodes_and_a_port_squatter_is_avoided(run_dir: Path) -> None:
    outcomes = two_jobs_and_a_port_squatter(run_dir, num_rollout=4)
    for outcome, name in zip(outcomes, ("job-a", "job-b")):
        assert outcome.exit_code == 0, outcome.output[-3000:]
        assert outcome.rollout_ids == list(range(4))
        assert (outcome.samples_lost, outcome.samples_duplicated) == (0, 0)
        assert outcome.left_behind == []
        assert "is in use; using" in (run_dir / name / "logs" / "controller.log").read_text()


def test_engine_node_dies_the_job_is_requeued_and_resumes(run_dir: Path) -> None:
    """A node dies (its slurmd and every process on it): the driver names the node and what ran there as
    soon as Slurm finds it not answering, requeues the job, and the job resumes from its last checkpoint."""
    outcome = kill_engine_node(run_dir, max_restarts=1, num_rollout=16, after_rollouts=2)
    assert outcome.exit_code == 0, outcome.output[-3000:]
    assert outcome.rollout_ids == list(range(16)), "each rollout once, in order"
    assert (outcome.samples_lost, outcome.samples_duplicated) == (0, 0)
    assert outcome.left_behind == []
    node = outcome.fault_node
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert re.search(rf"node {node} is lost \(Slurm state [a-z]+\*.*\); it ran engine-0; requeued job \d+ to resume "
                     r"from the last checkpoint on healthy nodes \(restart 1 of controller.max_restarts=1\)",
                     controller_log), controller_log[-3000:]
    assert "resuming at rollout" in controller_log
    assert outcome.slurm_down_seconds is not None and outcome.slurm_down_seconds < 60
    assert outcome.detected_seconds is not None and outcome.detected_seconds < outcome.slurm_down_seconds + 5, \
        "named as soon as Slurm finds the node not answering"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished"
    assert any(f"node {node} is lost" in r["reason"] for r in status["restarts"]), status["restarts"]
