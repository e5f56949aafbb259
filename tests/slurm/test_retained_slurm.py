"""Retained rollouts with an engine job on the local 3-node cluster (issue 35, test 4's last part): the tiny run's
het job (trainer at TP 1, checkpoints every 2 rollouts) and an engine job for it; the trainer's job is scancelled
while rollout 2 is generated and journaled, not trained (the controller's hold hook stops it there; the checkpoint
holds rollouts 0-1, weights v2). It is resubmitted into its run dir at TP 2 with the same --rollout-session-id: the
engine job's engine (the same process: its request counter goes on) re-joins the new controller, which pushes it
the checkpoint's weights; rollout 2 is trained from the journal, not generated again (counted on the engines'
/metrics), rollouts 3-4 are generated; nothing lost or trained twice. Prints the resubmit -> retained batch trained
time and the generations saved (docs/faults.md, "Retained rollouts").

The engine job certainly takes part in the first attempt: the trainer's own engine starts held (the CPU engine's
hold gate, `faults.HOLD_GENERATION`, in the first trainer job's environment only) and is let go once the engine job
joined; otherwise a joiner that starts slower than the trainer's three short rollouts (0.1-0.5 s each) would come
after the hold and never serve that controller."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.controller.fault_hooks import HOLD_CONTROLLER_AFTER_RETAIN
from hpc_rl.controller.retention import JOURNAL, RolloutJournal
from hpc_rl.engines.cpu.faults import HOLD_GENERATION
from hpc_rl.launch.slurm_status import component_states, job_state
from hpc_rl.protocol.http_client import request_blocking
from hpc_rl.protocol.secret import engine_api_key, load_secret, secret_path
from tests.integration.run_helpers import records, wait_for
from tests.slurm.test_engine_jobs_slurm import ENDED, engine_environment, engine_jobs, serving_job, submit_engines

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
ROLLOUTS, SAMPLES, RETAINED = 5, 16 * 8, 2
SESSION = "slurm-retained"


def submit_trainer(run_dir: Path, *flags: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "slurm",
                           "--run-dir", str(run_dir), "--num-rollout", str(ROLLOUTS), "--eval-interval", "100000",
                           "--save-interval", "2", "--rollout-session-id", SESSION,
                           "--rollout-cleanup-timeout", "300", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return (run_dir / "slurm_job_id").read_text().strip()


def requests_total(url: str, key: str) -> int:
    """The engine's generation requests finished so far (SGLang's sglang:num_requests_total; a restart resets it)."""
    status, body = request_blocking("GET", f"{url}/metrics", None, timeout_s=10, api_key=key)
    match = re.search(rb"^sglang:num_requests_total\{[^}]*\} (\S+)$", body, re.MULTILINE)
    assert status == 200 and match is not None, body
    return int(float(match.group(1)))


def running(job: str) -> bool:
    return job_state(component_states(job)) in ("RUNNING", "PENDING")


def ended(job: str) -> bool:
    """Slurm says the job ended (a state read right after its end can still be COMPLETING, or UNKNOWN when sacct and
    squeue did not answer: neither is taken for the end)."""
    return job_state(component_states(job)) in ENDED


def joined(run_dir: Path, job: str) -> bool:
    """An engine of engine job `job` is registered with the run's controller and serving (requests or not)."""
    return any(e.get("state") == "serving" for e in (engine_jobs(run_dir).get(job) or {}).get("engines", {}).values())


def het_engine_url(run_dir: Path) -> str | None:
    try:
        engines = json.loads((run_dir / "status.json").read_text())["components"]["engines"]
        return engines["0"]["url"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.timeout(900)
def test_a_resubmitted_trainer_at_another_tp_trains_the_retained_rollout_with_the_engine_jobs_engines(
        run_dir: Path) -> None:
    marker = run_dir.parent / f"{run_dir.name}-held"
    hold_gate = run_dir.parent / f"{run_dir.name}-hold-generation"
    hold_gate.touch()  # the first attempt's own engine generates nothing until the engine job joined
    first = submit_trainer(run_dir, env={HOLD_CONTROLLER_AFTER_RETAIN: f"{RETAINED}:{marker}",
                                         HOLD_GENERATION: str(hold_gate)})
    jobs = [first]
    try:
        engine_job = submit_engines(run_dir)
        jobs.append(engine_job)
        wait_for(lambda: joined(run_dir, engine_job), 400, f"engine job {engine_job} to join the first attempt")
        wait_for(lambda: het_engine_url(run_dir) is not None, 400, "the trainer job's engine to register")
        held = engine_environment(het_engine_url(run_dir)).get(HOLD_GENERATION)
        assert held == str(hold_gate), f"the gate did not reach the trainer job's engine step: {held}"
        hold_gate.unlink()
        wait_for(lambda: serving_job(run_dir, engine_job) is not None, 400, f"engine job {engine_job} to serve")
        url = serving_job(run_dir, engine_job)["url"]
        key = engine_api_key(load_secret(secret_path(run_dir)))
        wait_for(marker.exists, 400, f"rollout {RETAINED} journaled (the hold)")
        served_before = requests_total(url, key)
        assert served_before > 0  # the engine job took part in the first attempt
        subprocess.run(["scancel", first], check=True)
        wait_for(lambda: ended(first), 120, "the trainer's job to end")
        assert [r["rollout_id"] for r in records(run_dir)] == list(range(RETAINED))
        journaled, _ = RolloutJournal(run_dir / JOURNAL).read()
        assert [(r.rollout_id, r.weight_version, r.num_samples) for r in journaled] == [(RETAINED, RETAINED, SAMPLES)]
        assert requests_total(url, key) == served_before and running(engine_job)  # it waits for a controller

        started = time.monotonic()
        second = submit_trainer(run_dir, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2")
        jobs.append(second)
        het_served = 0  # the new job's own engine: read until it stops with the job
        reattach_s = None
        while not ended(second):
            het = het_engine_url(run_dir)
            if het and het != url:
                try:
                    het_served = max(het_served, requests_total(het, key))
                except OSError:  # not up yet, or stopped with the job (a 401 fails: the key changed)
                    pass
            if reattach_s is None and any("rollout/retained_samples_trained" in r["metrics"] for r in records(run_dir)):
                reattach_s = time.monotonic() - started
            assert time.monotonic() - started < 600, "the resubmitted job did not end"
            time.sleep(0.1)
        assert job_state(component_states(second)) == "COMPLETED", (
            (run_dir / "logs" / "controller.log").read_text()[-3000:])
        assert running(engine_job)  # the same engine job, never restarted
        served_after = requests_total(url, key)
    finally:
        subprocess.run(["scancel", *jobs], check=False)
    log = (run_dir / "logs" / "controller.log").read_text()
    assert f"re-attached to session '{SESSION}': 1 retained rollout(s) [{RETAINED}] ({SAMPLES} samples)" in log
    assert f"weights v{RETAINED} pushed (resumed from a checkpoint)" in log
    rejoined = engine_jobs(run_dir)[engine_job]["engines"]  # the new controller's view: the same engine re-joined
    assert [(e["url"], e["state"]) for e in rejoined.values()] == [(url, "serving")], rejoined
    assert all(e["first_request_s"] is not None for e in rejoined.values())  # it took the new controller's requests
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == list(range(ROLLOUTS))
    every = [i for r in rows for i in r["sample_indices"]]
    assert sorted(every) == list(range(ROLLOUTS * SAMPLES)), "a sample lost or trained twice"
    assert rows[RETAINED]["sample_indices"] == [s.index for g in journaled[0].groups for s in g]
    assert rows[RETAINED]["metrics"]["rollout/retained_samples_trained"] == SAMPLES
    assert rows[RETAINED]["metrics"]["rollout/generations_saved"] == SAMPLES
    for row in rows:  # every engine served the trainer's weights (the re-joined one: the checkpoint's, pushed)
        assert row["metrics"]["train/train_rollout_logprob_abs_diff"] < 1e-4, (row["rollout_id"], row["metrics"])
    generated = served_after - served_before + het_served
    assert served_after > served_before and generated == (ROLLOUTS - RETAINED - 1) * SAMPLES, (
        served_before, served_after, het_served)  # rollout 2 was not generated again
    assert not (run_dir / JOURNAL).exists()
    status = subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert f"retained rollouts: 0 journaled [], 0 to train first; {SAMPLES} generation(s) saved" in status.stdout
    print(f"\nretained on Slurm: resubmit -> retained rollout trained {reattach_s:.1f} s; generations saved "
          f"{SAMPLES} of {(ROLLOUTS - RETAINED) * SAMPLES} the resume trained; engine job's engine served "
          f"{served_before} + {served_after - served_before}, the new job's engine {het_served}; "
          f"load {Path('/proc/loadavg').read_text().split()[:3]}")
