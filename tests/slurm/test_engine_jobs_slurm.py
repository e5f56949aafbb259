"""Engines as their own Slurm jobs (issue 35) on the local 3-node cluster: the tiny run's het job (trainer and one
engine), then two engine jobs for it (`python -m hpc_rl.submit --engines-for RUN_DIR`). Both join and take requests;
one is scancelled mid-rollout (its requests go back to the rollout: every rollout still trains exactly its samples,
none twice), a new one is submitted and serves the controller's current weight version (its /model_info, and every
rollout's engine log-probs equal the trainer's); `python -m hpc_rl.status` lists the engine jobs with their Slurm
ids and states. Then the trainer's job is scancelled: the engine jobs end on their own (no controller for
rollout_cleanup_timeout).

The scancelled job's requests are certainly in flight at the scancel: the test opens the CPU engine's hold gate
(`faults.HOLD_GENERATION`, in that job's environment only: sbatch exports the submitter's, and the test checks its
engine process has it) before it, so that engine decodes nothing more and what the controller sends it stays there,
as in tests/integration/test_engine_jobs.py (without the gate, 24-token answers can finish between the live status
showing them and the signal). Slurm's answers are polled until they settle (sacct lags the job's end), never read
once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.engines.cpu.faults import HOLD_GENERATION, HOLD_POLL_S
from hpc_rl.launch.slurm_status import component_states, job_state
from hpc_rl.protocol.http_client import request_blocking
from hpc_rl.protocol.secret import engine_api_key, load_secret, secret_path
from tests.integration.run_helpers import controller_version, live, processes_mentioning, records, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
ROLLOUTS = 500
"""More than the test waits for (rollouts take 1-4 s here): the run is scancelled once the checks are done."""
SAMPLES_PER_ROLLOUT = 16 * 8
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")
"""Slurm's final job states: a state polled right after a job's end can still be RUNNING, COMPLETING or (sacct
and squeue both unanswered) UNKNOWN."""


def engine_jobs(run_dir: Path) -> dict[str, dict]:
    try:
        return json.loads((run_dir / "status.json").read_text()).get("engine_jobs") or {}
    except (OSError, ValueError):
        return {}


def serving_job(run_dir: Path, job_id: str) -> dict | None:
    """The engine of `job_id` once it took a request (the controller measured its first one)."""
    for engine in (engine_jobs(run_dir).get(job_id) or {}).get("engines", {}).values():
        if engine.get("first_request_s") is not None:
            return engine
    return None


def submit_engines(run_dir: Path, **env: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hpc_rl.submit", "--engines-for", str(run_dir), "--executor", "slurm"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return re.search(r"engine job (\d+) submitted", done.stdout).group(1)


def in_flight(run_dir: Path, job_id: str) -> int:
    """Requests on `job_id`'s engines, from the controller's live status (0 while it has none to say)."""
    engines = (live(run_dir).get("engine_jobs") or {}).get(job_id, {}).get("engines") or {}
    return sum(int(engine.get("in_flight") or 0) for engine in engines.values())


def engine_environment(url: str) -> dict[str, str]:
    """The environment of the CPU engine serving at `url` (a process on this machine: the nodes are virtual)."""
    port = url.rsplit(":", 1)[1]
    (process,) = [line for line in processes_mentioning("hpc_rl.engines.cpu") if f"--port {port} " in line + " "
                  and not line.partition(": ")[2].startswith("srun")]  # a het job's engine step: srun's too
    entries = Path(f"/proc/{process.split(':', 1)[0]}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def status_lists(run_dir: Path, *expected: str) -> str:
    """`python -m hpc_rl.status`'s output once every pattern in `expected` is in it (Slurm's accounting lags a
    scancel by seconds): the last output in the error when that does not come."""
    outputs = [""]

    def listed() -> bool:
        outputs[0] = subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir)], cwd=REPO,
                                    capture_output=True, text=True, timeout=60).stdout
        return all(re.search(pattern, outputs[0]) for pattern in expected)

    try:
        wait_for(listed, 120, f"python -m hpc_rl.status to list {expected}", interval_s=2.0)
    except AssertionError as error:
        raise AssertionError(f"{error}; its last output:\n{outputs[0]}") from None
    return outputs[0]


@pytest.mark.timeout(900)
def test_engine_jobs_join_leave_on_scancel_and_a_new_one_serves_the_current_weights(run_dir: Path) -> None:
    submitted = subprocess.run([sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "slurm",
                                "--run-dir", str(run_dir), "--num-rollout", str(ROLLOUTS), "--eval-interval", "100",
                                "--rollout-max-response-len", "24", "--rollout-cleanup-timeout", "20"],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    trainer_job = (run_dir / "slurm_job_id").read_text().strip()
    jobs: list[str] = []
    try:
        wait_for(lambda: len(records(run_dir)) >= 1, 400, "the run's first rollout")
        hold_gate = run_dir / "hold-the-first-engine-jobs-generation"
        jobs = [submit_engines(run_dir, **{HOLD_GENERATION: str(hold_gate)}), submit_engines(run_dir)]
        for job in jobs:
            wait_for(lambda: serving_job(run_dir, job) is not None, 300, f"engine job {job} to join and serve")
        held_env = engine_environment(serving_job(run_dir, jobs[0])["url"])
        assert held_env.get(HOLD_GENERATION) == str(hold_gate), f"the gate did not reach engine job {jobs[0]}'s engine"
        assert HOLD_GENERATION not in engine_environment(serving_job(run_dir, jobs[1])["url"])
        trained_before_hold = len(records(run_dir))
        wait_for(lambda: len(records(run_dir)) > trained_before_hold, 300,
                 "a rollout trained after both engine jobs served (their answers are checked below)")
        hold_gate.touch()  # from here jobs[0]'s engine decodes nothing: a request on it stays until aborted
        time.sleep(40 * HOLD_POLL_S)  # a step under way when the gate opened has ended (a decode step: ms)
        wait_for(lambda: in_flight(run_dir, jobs[0]) > 0, 120, f"requests held on engine job {jobs[0]}",
                 interval_s=0.02)
        subprocess.run(["scancel", jobs[0]], check=True)  # mid-rollout, with requests on it
        wait_for(lambda: engine_jobs(run_dir).get(jobs[0], {}).get("state") in ("left", "failed"), 120,
                 f"engine job {jobs[0]} out of the run")
        gone = next(iter(engine_jobs(run_dir)[jobs[0]]["engines"].values()))
        print(f"scancelled engine job: {gone['state']}, {gone.get('requeued')} request(s) requeued in "
              f"{gone.get('drain_s')} s")
        jobs.append(submit_engines(run_dir))
        wait_for(lambda: serving_job(run_dir, jobs[2]) is not None, 300, f"engine job {jobs[2]} to join and serve")
        new = serving_job(run_dir, jobs[2])
        key = engine_api_key(load_secret(secret_path(run_dir)))
        before = controller_version(run_dir)  # the run goes on: the version the engine serves is read between two
        _, info = request_blocking("GET", f"{new['url']}/model_info", None, timeout_s=10, api_key=key)
        served, after = int(json.loads(info)["weight_version"]), controller_version(run_dir)  # of the controller's
        assert served >= 1 and before - 1 <= served <= after + 1, (before, served, after)
        status_lists(run_dir, rf"engine job {jobs[0]}: slurm CANCELLED",
                     rf"engine job {jobs[2]}: slurm RUNNING; engine \d+ serving")
        subprocess.run(["scancel", trainer_job], check=True)
        wait_for(lambda: all(job_state(component_states(j)) in ENDED for j in jobs[1:]), 120,
                 "the engine jobs to end without a controller (rollout_cleanup_timeout)")
    finally:
        subprocess.run(["scancel", trainer_job, *jobs], check=False)
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == list(range(len(rows))) and len(rows) >= 3
    for row in rows:  # nothing lost or trained twice; every engine served the trainer's weights
        assert len(row["sample_indices"]) == len(set(row["sample_indices"])) == SAMPLES_PER_ROLLOUT, row["rollout_id"]
        assert row["metrics"]["train/train_rollout_logprob_abs_diff"] < 1e-4, (row["rollout_id"], row["metrics"])
    # The held requests came back: aborted by the leave (requeued), or failed when Slurm's SIGTERM ended the engine
    # before its agent left (then the leave finds none: "0 request(s) requeued"); either way sent again.
    came_back = sum(row["metrics"].get(f"rollout/requests_{end}", 0) for row in rows
                    for end in ("aborted", "transport_failed", "http_failed"))
    assert came_back > 0, "no request of the scancelled engine job came back to the rollout"
    print(f"requests that came back to the rollout: {came_back:.0f}")
    ended = {j: job_state(component_states(j)) for j in jobs[1:]}
    assert all(state == "COMPLETED" for state in ended.values()), ended
