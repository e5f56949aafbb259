"""The embedded default through a real het job on the local cluster, with the real driver.

Decoupled: trainer ranks on 2 virtual nodes (het group 0), the CPU engine on a third (het group 1).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.run_helpers import processes_mentioning, records, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def submit(run_dir: Path, *flags: str, wait: bool = True) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "slurm",
            "--run-dir", str(run_dir), "--actor-num-nodes", "2", *flags] + (["--wait"] if wait else [])
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_tiny_run_completes_through_a_het_job(run_dir: Path) -> None:
    process = submit(run_dir, "--num-rollout", "5")
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]
    assert "COMPLETED" in output
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3, 4]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    status = subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0 and "rollout 5/5" in status.stdout and "slurm:" in status.stdout
    assert processes_mentioning(str(run_dir)) == []


def test_scancel_mid_run_leaves_no_process(run_dir: Path) -> None:
    process = submit(run_dir, "--num-rollout", "500", wait=False)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    job_id = (run_dir / "slurm_job_id").read_text().strip()
    wait_for(lambda: len(records(run_dir)) >= 2, 300, "two rollouts")
    subprocess.run(["scancel", job_id], check=True)
    wait_for(lambda: processes_mentioning(str(run_dir)) == [], 90, "every process of the job to end")


def test_time_limit_checkpoint_requeue_resume(run_dir: Path) -> None:
    """A 2-minute limit: USR2 -> save at a rollout boundary -> requeue -> resume -> all rollouts done once."""
    num_rollout = 150
    process = submit(run_dir, "--num-rollout", str(num_rollout), "--rollout-max-response-len", "24",
                     "--eval-interval", "1000", "--save", str(run_dir / "ckpt"),
                     "--set", "slurm.time=2", "--set", "slurm.requeue_signal_seconds=50")
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-3000:]
    rows = records(run_dir)
    ids = [r["rollout_id"] for r in rows]
    assert sorted(set(ids)) == list(range(num_rollout)), "rollouts missing"
    assert len(ids) == num_rollout, "a rollout ran twice"
    assert "stopping after rollout" in "".join(p.read_text() for p in (run_dir / "submitit").glob("*_log.out"))
