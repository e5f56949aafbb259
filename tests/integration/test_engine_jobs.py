"""Engines as their own job (issue 35), real processes on this machine: a tiny local run (its controller, trainer and
one CPU engine), then an engine job for it (`python -m hpc_rl.submit --engines-for RUN_DIR --executor local`: a real
CPU engine and its agent). The joiner registers mid-run, gets the trainer's current weights before it serves (every
rollout's engine log-probs equal the trainer's, and its /model_info reports the controller's version), takes
requests, then leaves on SIGTERM while a rollout generates: its requests are aborted and requeued, and every
rollout still trains exactly rollout_batch_size x n_samples_per_prompt samples, none twice.

The joiner's requests are certainly in flight at the SIGTERM: before it, the test opens the CPU engine's hold gate
(`faults.HOLD_GENERATION`, set only in the engine job's environment), so the joiner decodes nothing more and what
the controller sends it stays there. Without the gate, answers of 24 tokens finished between the live status
showing them and the signal: a CI run once saw "left: 0 request(s) requeued".

The run cannot end before the joiner comes either: the run's own engine has a gate of its own (in the run's
environment), opened once the run has trained its first rollout and closed once the joiner has registered, so the
run waits mid-rollout meanwhile (a quiet machine trains a rollout in ~0.3 s, and an engine job starts in 10-30 s)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.engines.cpu.faults import HOLD_GENERATION, HOLD_POLL_S
from hpc_rl.protocol.http_client import request_blocking
from hpc_rl.protocol.secret import engine_api_key, load_secret, secret_path
from tests.integration.run_helpers import REPO_ROOT, controller_version, live, records, start_run, wait_for

pytestmark = pytest.mark.slow

ROLLOUTS = 80  # the engine job joins ~10-30 s after its submit (a CPU engine loading), while a rollout takes
# 0.3-4 s: at 20 the run once ended (quiet machine, ~0.5 s a rollout) before the joiner came
SAMPLES_PER_ROLLOUT = 16 * 8  # configs/tiny_cpu.yaml: rollout_batch_size x n_samples_per_prompt


def engine_job_records(run_dir: Path) -> dict[str, dict]:
    try:
        return json.loads((run_dir / "status.json").read_text()).get("engine_jobs") or {}
    except (OSError, ValueError):
        return {}


def joined_engine(run_dir: Path) -> dict | None:
    for job in engine_job_records(run_dir).values():
        for engine in job["engines"].values():
            return engine
    return None


def joined_in_flight(run_dir: Path) -> int:
    """Requests in flight on the engine job's engine, from the controller's live status (0 while it has none to say:
    a status call that timed out, or no engine job yet)."""
    for job in (live(run_dir).get("engine_jobs") or {}).values():
        for engine in (job.get("engines") or {}).values():
            return int(engine.get("in_flight") or 0)
    return 0


@pytest.mark.timeout(900)
def test_an_engine_job_joins_with_the_current_weights_and_leaves_losing_nothing(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    run_gate = tmp_path / "hold-the-runs-own-engine"
    monkeypatch.setenv(HOLD_GENERATION, str(run_gate))  # the run's environment (the engine job gets its own gate)
    run = start_run(run_dir, "--num-rollout", str(ROLLOUTS), "--rollout-max-response-len", "24",
                    "--eval-interval", "100", "--rollout-cleanup-timeout", "30")
    job_out = tmp_path / "engine-job.out"
    hold_gate = tmp_path / "hold-the-joiners-generation"
    job = None
    try:
        wait_for(lambda: len(records(run_dir)) >= 1, 400, "the run's first rollout (weights v1 pushed after it)")
        run_gate.touch()  # the run waits mid-rollout until the joiner has registered: it cannot end before
        job = subprocess.Popen([sys.executable, "-m", "hpc_rl.submit", "--engines-for", str(run_dir), "--executor",
                                "local"], cwd=REPO_ROOT, stdout=open(job_out, "w"), stderr=subprocess.STDOUT,
                               start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
                                                               HOLD_GENERATION: str(hold_gate)})
        wait_for(lambda: joined_engine(run_dir) is not None, 300, f"the engine job's engine to register ({job_out})")
        run_gate.unlink()
        wait_for(lambda: (joined_engine(run_dir) or {}).get("first_request_s") is not None, 300,
                 f"the engine job's engine to take a request ({job_out})")
        engine = joined_engine(run_dir)
        key = engine_api_key(load_secret(secret_path(run_dir)))
        before = controller_version(run_dir)  # the run goes on: the version the engine serves is read between two
        status, info = request_blocking("GET", f"{engine['url']}/model_info", None, timeout_s=10, api_key=key)
        served, after = int(json.loads(info)["weight_version"]), controller_version(run_dir)  # of the controller's
        assert status == 200 and served >= 1 and before - 1 <= served <= after + 1, (before, served, after)
        trained_before_hold = len(records(run_dir))
        wait_for(lambda: len(records(run_dir)) > trained_before_hold, 300,
                 "a rollout trained after the joiner took requests (its answers are checked below)")
        hold_gate.touch()  # from here the joiner decodes nothing: a request on it stays until aborted
        time.sleep(40 * HOLD_POLL_S)  # a step under way when the gate opened has ended (a decode step: ms)
        wait_for(lambda: joined_in_flight(run_dir) > 0, 120, "requests held on the engine job's engine",
                 interval_s=0.02)
        left_during = len(records(run_dir))
        os.killpg(job.pid, signal.SIGTERM)  # what Slurm sends at the end of the job: mid-rollout, requests on it
        assert job.wait(120) == 0, job_out.read_text()[-3000:]
        assert run.wait(600) == 0, (run_dir.parent / f"{run_dir.name}.out").read_text()[-3000:]
    finally:
        for process in (job, run):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert left_during < ROLLOUTS, "the run ended before the engine left: nothing was tested mid-run"
    output = job_out.read_text()
    left = re.search(r"left: (\d+) request\(s\) requeued in ([\d.]+) s", output)
    assert left is not None and int(left.group(1)) > 0, output[-3000:]  # they were requeued, and none lost:
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == list(range(ROLLOUTS))
    for row in rows:  # nothing lost or trained twice; every engine served the trainer's weights
        assert len(row["sample_indices"]) == len(set(row["sample_indices"])) == SAMPLES_PER_ROLLOUT, row["rollout_id"]
        assert row["metrics"]["train/train_rollout_logprob_abs_diff"] < 1e-4, (row["rollout_id"], row["metrics"])
    final = engine_job_records(run_dir)
    (job_record,) = final.values()
    (engine_record,) = job_record["engines"].values()
    assert engine_record["state"] == "left" and engine_record["requeued"] == int(left.group(1))
    print(f"engine job: registration -> first request {engine_record['first_request_s']} s; leave: "
          f"{left.group(1)} request(s) requeued in {left.group(2)} s (load {os.getloadavg()[0]:.1f})")
