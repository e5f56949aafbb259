"""Het jobs through hpc_rl's submitit extension on the real local cluster (tools/local_slurm.sh up).

The drivers are the small ones of `het_callables` (seconds, not minutes); they use the same
`SrunStepLauncher` and `HetJobDriver` as the real driver. A scancel mid-run and a time limit's USR2 ->
save -> requeue -> resume are test_tiny_run_slurm.py's, once each, with the real driver (each Slurm wait
runs once in CI).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpc_rl.config import load_config, write_resolved_config
from hpc_rl.launch.slurm_status import component_states, describe_slurm_status, job_state, read_job_id
from hpc_rl.launch.slurm_submit import EXIT_OK, submit_job, wait_for_job

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
    # Accounting records reach slurmdbd a moment after the job ends (squeue answers meanwhile, COMPLETING).
    components = {f"{job.job_id}+0", f"{job.job_id}+1"}
    _eventually(lambda: {s.job_id for s in component_states(job.job_id)} == components
                and job_state(component_states(job.job_id)) == "COMPLETED", 30, "both components, COMPLETED")
    assert "COMPLETED" in describe_slurm_status(run_dir)
    print(f"het job submit-to-finish: {elapsed:.1f}s")


def test_step_stop_ends_tasks_on_every_node(run_dir: Path) -> None:
    """SrunStep.stop(): SIGTERM through srun; a task ignoring TERM is killed through scancel of its step."""
    config = _config(run_dir, "--set", "slurm.time=5")
    job = submit_job(config, driver=f"{CALLABLES}:stopping_driver")
    assert wait_for_job(job, poll_seconds=0.5) == EXIT_OK
    before, after, *_ = (run_dir / "stopped").read_text().split(maxsplit=2)
    assert (int(before), int(after)) == (3, 0)
