"""The embedded default through a real het job on the local cluster, with the real driver.

Decoupled: trainer ranks on 2 virtual nodes (het group 0), the CPU engines on a third (het group 1).
The first run asks Slurm for the fake GPUs a GPU run would use (`slurm.gpus_for_cpu_runs`): each step
sees the GPUs Slurm gave it (two engines on one node, each with a GPU of its own).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpc_rl.launch.slurm_status import component_states, job_state
from tests.integration.run_helpers import placement, processes_mentioning, records, wait_for
from tests.slurm.fault_runs import let_requeued_job_finish

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
STOPPED_FOR_REQUEUE = re.compile(r"stopping after rollout (\d+) for requeue")


def submit(run_dir: Path, *flags: str, wait: bool = True) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "slurm",
            "--run-dir", str(run_dir), "--actor-num-nodes", "2", *flags] + (["--wait"] if wait else [])
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_tiny_run_completes_through_a_het_job(run_dir: Path) -> None:
    process = submit(run_dir, "--num-rollout", "5", "--rollout-num-gpus", "2", "--set", "slurm.gpus_for_cpu_runs=true")
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]
    assert "COMPLETED" in output
    trainers, engines, reports = placement(run_dir)
    assert trainers == {0: "node1/gpu0", 1: "node2/gpu0"}  # one GPU per trainer node, from Slurm
    assert sorted(engines.values()) == [["node3/gpu0"], ["node3/gpu1"]]  # one each, Slurm's choice of which
    assert all(r["base_gpu_id"] == 0 and len(r["step_gpus"]) == 1 for r in reports.values()), reports
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3, 4]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    status = subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0 and "rollout 5/5" in status.stdout and "slurm:" in status.stdout
    assert processes_mentioning(str(run_dir)) == []


def test_scancel_mid_run_leaves_no_process(run_dir: Path) -> None:
    """The one scancel test (test_het_jobs.py had a twin with sleeping steps): every process of the run, on
    every node, ends, and Slurm accounts the job as cancelled."""
    process = submit(run_dir, "--num-rollout", "500", wait=False)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    job_id = (run_dir / "slurm_job_id").read_text().strip()
    wait_for(lambda: len(records(run_dir)) >= 2, 300, "two rollouts")
    subprocess.run(["scancel", job_id], check=True)
    wait_for(lambda: processes_mentioning(str(run_dir)) == [], 90, "every process of the job to end")
    wait_for(lambda: job_state(component_states(job_id)).startswith("CANCELLED"), 30, "state CANCELLED")


def submitit_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*_log.out"))


def set_num_rollout(run_dir: Path, num_rollout: int) -> None:
    """Change the run's length in its resolved config (what a requeued job reads when it starts again)."""
    path = run_dir / "config.resolved.yaml"
    resolved = yaml.safe_load(path.read_text())
    resolved["rollout"]["num_rollout"] = num_rollout
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))


def test_time_limit_checkpoint_requeue_resume(run_dir: Path) -> None:
    """A 2-minute limit: USR2 -> save at a rollout boundary -> requeue -> resume -> all rollouts done once
    (the one requeue-on-time-limit test: test_het_jobs.py's twin with a counting driver went).

    What it proves does not depend on the machine's speed: the run asks for far more rollouts than an
    allocation can do; once the first allocation has stopped for requeue after rollout k (the time
    limit's USR2), the run is shortened to k + 3 and the requeued job gets a 15-minute limit before it
    starts, so the second allocation resumes at k and finishes.
    """
    process = submit(run_dir, "--num-rollout", "100000", "--rollout-max-response-len", "24",
                     "--eval-interval", "100000", "--save", str(run_dir / "ckpt"),
                     "--set", "slurm.time=2", "--set", "slurm.requeue_signal_seconds=50")
    try:
        wait_for(lambda: STOPPED_FOR_REQUEUE.search(submitit_logs(run_dir)) or process.poll() is not None, 600,
                 "the first allocation to stop for requeue")
        match = STOPPED_FOR_REQUEUE.search(submitit_logs(run_dir))
        assert match, f"the job ended without stopping for requeue:\n{submitit_logs(run_dir)[-3000:]}"
        first_allocation = int(match.group(1))
        num_rollout = first_allocation + 3
        set_num_rollout(run_dir, num_rollout)
        let_requeued_job_finish((run_dir / "slurm_job_id").read_text().strip(), time_limit_minutes=15)
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            subprocess.run(["scancel", (run_dir / "slurm_job_id").read_text().strip()], check=False)
    assert process.returncode == 0, output[-3000:]
    ids = [r["rollout_id"] for r in records(run_dir)]
    assert first_allocation >= 1
    assert sorted(set(ids)) == list(range(num_rollout)), "rollouts missing"
    assert len(ids) == num_rollout, "a rollout ran twice"
    assert f"resuming at rollout {first_allocation}" in (run_dir / "logs" / "controller.log").read_text()
    assert len(STOPPED_FOR_REQUEUE.findall(submitit_logs(run_dir))) == 1
