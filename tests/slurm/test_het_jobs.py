"""Het jobs through hpc_rl's submitit extension on the real local cluster (tools/local_slurm.sh up).

The drivers are the small ones of `het_callables` (seconds, not minutes); they use the same
`SrunStepLauncher`, `HetJobDriver` and USR2 path as the real driver.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from hpc_rl.config import load_config, write_resolved_config
from hpc_rl.launch.slurm_status import component_states, describe_slurm_status, job_state, read_job_id
from hpc_rl.launch.slurm_submit import EXIT_NOT_FINISHED, EXIT_OK, submit_job, wait_for_job

pytestmark = pytest.mark.slurm
CALLABLES = "tests.slurm.het_callables"


def _config(run_dir: Path, *flags: str):  # -> RunConfig
    config = load_config(["configs/tiny_cpu.yaml"],
                         ["--actor-num-nodes", "2", "--set", f"run_dir={run_dir}", *flags])
    write_resolved_config(config, run_dir)
    return config


def _eventually(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_het_job_runs_to_completion_and_reports_state(run_dir: Path) -> None:
    config = _config(run_dir, "--set", "slurm.time=5")
    start = time.monotonic()
    job = submit_job(config, driver=f"{CALLABLES}:where_driver")
    assert read_job_id(run_dir) == job.job_id
    assert wait_for_job(job, poll_seconds=0.5) == EXIT_OK
    elapsed = time.monotonic() - start
    trainer_nodes = {(run_dir / f"trainer-{rank}.node").read_text().strip() for rank in (0, 1)}
    engine_node = (run_dir / "engine.node").read_text().strip()
    assert len(trainer_nodes) == 2 and engine_node not in trainer_nodes  # components never share a node
    assert (run_dir / "addresses").read_text().split() == ["127.0.0.1"] * 3  # node names resolve
    assert job.result() == 0
    _eventually(lambda: job.watcher.get_state(job.job_id, mode="force") == "COMPLETED", 30, "state COMPLETED")
    # Accounting records reach slurmdbd a moment after the job ends (squeue answers meanwhile).
    components = {f"{job.job_id}+0", f"{job.job_id}+1"}
    _eventually(lambda: {s.job_id for s in component_states(job.job_id)} == components, 30, "both components")
    assert job_state(component_states(job.job_id)) == "COMPLETED"
    assert "COMPLETED" in describe_slurm_status(run_dir)
    print(f"het job submit-to-finish: {elapsed:.1f}s")


def _processes(pattern: str) -> list[str]:
    """Command lines of this machine's processes matching `pattern` (every virtual node runs here)."""
    out = subprocess.run(["pgrep", "-af", pattern], check=False, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def test_scancel_leaves_no_process_on_any_node(run_dir: Path) -> None:
    config = _config(run_dir, "--set", "slurm.time=5")
    job = submit_job(config, driver=f"{CALLABLES}:sleeping_driver")
    tag = f"^hpcrl-sleep-{run_dir.name}"  # the tasks' argv[0] (not the srun command lines)
    _eventually(lambda: len(_processes(tag)) == 3, 60, "3 sleeping tasks (2 trainer nodes + 1 engine node)")
    assert _processes(str(run_dir / "submitit"))  # the driver (batch step) runs
    job.cancel()
    assert wait_for_job(job, poll_seconds=0.5) == EXIT_NOT_FINISHED
    _eventually(lambda: job.watcher.get_state(job.job_id, mode="force").startswith("CANCELLED"), 30, "CANCELLED")
    _eventually(lambda: not _processes(tag) and not _processes(str(run_dir)), 30,
                "every process of the job to be gone")


def test_time_limit_checkpoints_requeues_and_resumes(run_dir: Path) -> None:
    # 2-minute limit, USR2 30 s before it (Slurm may send it up to 60 s early): 100 one-second steps
    # cannot fit in one run, so the job must save, requeue and resume at least once.
    config = _config(run_dir, "--set", "slurm.time=2", "--set", "slurm.requeue_signal_seconds=30",
                     "--set", "slurm.max_num_timeout=4")
    (run_dir / "target").write_text("100\n")
    start = time.monotonic()
    job = submit_job(config, driver=f"{CALLABLES}:counting_driver")
    assert wait_for_job(job, poll_seconds=1.0) == EXIT_OK
    starts = [int(line) for line in (run_dir / "starts").read_text().split()]
    assert len(starts) >= 2 and starts[0] == 0 and starts[1] > 0, starts  # resumed from saved progress
    assert starts == sorted(starts)
    assert int((run_dir / "progress").read_text()) == 100
    print(f"requeued {len(starts) - 1} time(s); submit-to-finish {time.monotonic() - start:.0f}s")


def test_step_stop_ends_tasks_on_every_node(run_dir: Path) -> None:
    """SrunStep.stop(): SIGTERM through srun; a task ignoring TERM is killed through scancel of its step."""
    config = _config(run_dir, "--set", "slurm.time=5")
    job = submit_job(config, driver=f"{CALLABLES}:stopping_driver")
    assert wait_for_job(job, poll_seconds=0.5) == EXIT_OK
    before, after, *_ = (run_dir / "stopped").read_text().split(maxsplit=2)
    assert (int(before), int(after)) == (3, 0)
