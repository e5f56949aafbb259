"""Faults during a run on the local Slurm cluster: each one is recovered from, losing nothing, leaving nothing.

Scenarios and measurements live in `fault_runs.py` (shared with benchmarks/bench_faults.py, which also
runs the variants without restarts).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.slurm.fault_runs import kill_controller, kill_trainer_rank, two_jobs_and_a_port_squatter

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
    outcome = kill_controller(run_dir, max_restarts=1, num_rollout=5, after_rollouts=2)
    assert outcome.exit_code == 0, outcome.output[-3000:]
    assert outcome.rollout_ids == list(range(5))
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
