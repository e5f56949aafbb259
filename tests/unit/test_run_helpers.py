"""The whole-run tests' helpers find their own run's processes: on a shared machine (helpers and CI run
several at once) a test that kills "a trainer rank" must not kill another run's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integration.run_helpers import processes_mentioning, trainer_ranks_of_run

SLEEPER = "import time; time.sleep(60)"


def test_trainer_ranks_are_this_runs_not_another_runs(tmp_path: Path) -> None:
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    argv = [sys.executable, "-c", SLEEPER, "-m", "hpc_rl.training"]  # a rank's command line, as ps shows it
    started = [subprocess.Popen(argv, env={**os.environ, "HPC_RL_RUN_DIR": str(run_dir)})
               for run_dir in (theirs, mine, theirs)]
    agent = subprocess.Popen([sys.executable, "-c", SLEEPER, "-m", "hpc_rl.launch.bound_torchrun", "-m",
                              "hpc_rl.training"], env={**os.environ, "HPC_RL_RUN_DIR": str(mine)})
    try:
        machine_wide = {int(line.split(":")[0]) for line in processes_mentioning("-m hpc_rl.training")}
        assert {p.pid for p in started} <= machine_wide  # what the dead-trainer test picked from before
        assert trainer_ranks_of_run(mine) == [started[1].pid]  # old: any rank on the machine, theirs first
        assert sorted(trainer_ranks_of_run(theirs)) == sorted([started[0].pid, started[2].pid])
    finally:
        for process in (*started, agent):
            process.kill()
            process.wait()
