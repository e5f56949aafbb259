"""Faults during a run on the local Slurm cluster: each one ends clearly or is recovered from, losing nothing.

Scenarios and measurements live in `fault_runs.py` (shared with benchmarks/bench_faults.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.slurm.fault_runs import kill_trainer_rank

pytestmark = pytest.mark.slurm


def test_trainer_rank_killed_restarts_from_the_checkpoint(run_dir: Path) -> None:
    outcome = kill_trainer_rank(run_dir, rank=1, max_restarts=1, num_rollout=5, after_rollouts=2)
    assert outcome.exit_code == 0, outcome.output[-3000:]
    assert outcome.rollout_ids == list(range(5)), "each rollout once, in order (a checkpoint precedes each record)"
    assert (outcome.samples_lost, outcome.samples_duplicated) == (0, 0)
    assert outcome.left_behind == []
    driver_log = "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.err"))
    assert "trainer rank 1 (on node2) was killed by signal 9 (SIGKILL)" in driver_log, driver_log[-3000:]
    assert "restarting from the last checkpoint (restart 1 of 1)" in driver_log
    assert "resuming at rollout" in (run_dir / "logs" / "controller.log").read_text()


def test_trainer_rank_killed_without_restarts_names_the_rank(run_dir: Path) -> None:
    outcome = kill_trainer_rank(run_dir, rank=0, max_restarts=0, num_rollout=30, after_rollouts=1)
    assert outcome.exit_code == 1, outcome.output[-3000:]
    assert "trainer rank 0 (on node1) was killed by signal 9 (SIGKILL)" in outcome.output, outcome.output[-3000:]
    assert outcome.samples_duplicated == 0 and outcome.left_behind == []
    assert "killed by signal 9" in outcome.status, outcome.status
