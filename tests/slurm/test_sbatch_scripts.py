"""slurm/*.sbatch, submitted as they are with plain `sbatch` on the local cluster, finish a tiny run.

The script is the committed file (not a copy); what a user with a smaller cluster would change is given
the way sbatch allows without editing it: command-line options override its `#SBATCH` resource lines,
and HPC_RL_CONFIG / HPC_RL_FLAGS / HPC_RL_RUN_DIR choose the recipe (the tiny CPU task, colocated as
the Qwen3-4B recipe is) and where the run goes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.run_helpers import processes_mentioning, records, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
TINY_FLAGS = "--colocate --num-rollout 2 --rollout-batch-size 4 --global-batch-size 32"


def sacct_states(job_id: str) -> dict[str, str]:
    out = subprocess.run(["sacct", "-j", job_id, "--noheader", "--parsable2", "--format=JobName,State"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if line)


def test_colocated_recipe_script_finishes_a_tiny_run(run_dir: Path) -> None:
    script = REPO / "slurm" / "qwen3_4b_grpo.sbatch"
    env = {**os.environ, "HPC_RL_CONFIG": "configs/tiny_cpu.yaml", "HPC_RL_FLAGS": TINY_FLAGS,
           "HPC_RL_RUN_DIR": str(run_dir), "PYTHONPATH": os.pathsep.join(
               p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--wait", f"--chdir={REPO}", "--partition=debug", "--nodes=1", "--ntasks-per-node=1",
         "--cpus-per-task=2", "--gpus-per-node=1", "--time=15", f"--output={run_dir}/sbatch-%j.out", str(script)],
        env=env, capture_output=True, text=True, timeout=900)
    job_id = submitted.stdout.strip().split(";")[0]
    output = "".join(p.read_text(errors="replace") for p in run_dir.glob("sbatch-*.out"))
    assert submitted.returncode == 0, f"{submitted.stderr}\n{output[-3000:]}"
    assert [r["rollout_id"] for r in records(run_dir)] == [0, 1]
    assert "rollout 2/2" in output
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    states: dict[str, str] = {}

    def accounted() -> bool:  # slurmdbd records the job's end a moment after sbatch --wait returns
        states.update(sacct_states(job_id))
        return states.get("qwen3-4b-grpo") == "COMPLETED" and states.get("trainer") == "COMPLETED"

    try:
        wait_for(accounted, 60, "sacct to account the job and its trainer step COMPLETED", interval_s=1.0)
    except AssertionError as error:
        raise AssertionError(f"{error}: {states}") from None
    assert "engine-0" in states  # the engine ran as its own srun step of the script's allocation
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    wait_for(lambda: processes_mentioning(str(run_dir)) == [], 60, "every process of the job to end")
