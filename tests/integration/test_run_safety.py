"""Run safety on whole local runs (issue 24): one run per run dir, a dead run's truth and its resume, a reward
that hangs, SIGTERM, and a loss that turns NaN. Each case is timed (printed: docs/faults.md quotes
these numbers) and checked for processes left behind and rollouts lost or done twice.

The live run that a second submit is refused for, then SIGKILLed, is certainly still running then: the CPU engine's
hold gate (`faults.HOLD_GENERATION`, in that run's environment only) stops its generation first, so it cannot finish
its rollouts while the second submit starts (seconds on a loaded machine)."""

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

from hpc_rl.engines.cpu.faults import HOLD_GENERATION
from hpc_rl.launch.signals import TERM_GRACE_LOCAL_S
from hpc_rl.training.checkpoint_files import iteration_dir, latest_iteration
from tests.integration.run_helpers import REPO_ROOT, processes_of_run, records, run_to_end, start_run, wait_for

pytestmark = pytest.mark.slow

HANGING_REWARD = "tests/integration/plugins/hanging_reward.py:reward"


def status_of(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)


def gone_within(run_dir: Path, timeout_s: float) -> float:
    """Seconds until no process of the run is left (AssertionError naming them after `timeout_s`)."""
    started = time.monotonic()
    deadline = started + timeout_s
    while (left := processes_of_run(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left behind: {left}"
    return time.monotonic() - started


def test_one_run_per_run_dir_a_dead_run_told_and_resumed_and_a_finished_one_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "life"
    flags = ("--num-rollout", "60", "--save-interval", "5", "--keep-last", "2", "--set", "eval.eval_interval=null")
    hold_gate = tmp_path / "hold-the-first-runs-generation"
    monkeypatch.setenv(HOLD_GENERATION, str(hold_gate))
    first = start_run(run_dir, *flags)
    monkeypatch.delenv(HOLD_GENERATION)
    try:
        wait_for(lambda: latest_iteration(run_dir / "checkpoints") is not None and len(records(run_dir)) >= 7, 300,
                 "a checkpoint and 7 rollouts")
        hold_gate.touch()  # the run stays live (its engine generates nothing more) until it is killed below
        secret = (run_dir / "secret").read_bytes()

        started = time.monotonic()  # 1. a second submit into the live run's dir is refused, touching nothing
        second = run_to_end(run_dir, *flags, timeout_s=120)
        refused_s = time.monotonic() - started
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert "is in use by a live run" in second.stderr and f"pid {first.pid} on " in second.stderr
        assert "nothing was started" in second.stderr
        assert (run_dir / "secret").read_bytes() == secret  # old: overwritten, the live run died of BadMacError
        assert first.poll() is None

        os.kill(first.pid, signal.SIGKILL)  # 2. the driver dies without a word
        first.wait(30)
        cleaned_s = gone_within(run_dir, 30)  # its engine, router, torchrun and ranks die with it
        started = time.monotonic()
        told = status_of(run_dir)
        status_s = time.monotonic() - started
        assert "run: dead since " in told.stdout and f"pid {first.pid}" in told.stdout and "is gone" in told.stdout
        assert "last log line: " in told.stdout, told.stdout  # old: "run: running"
        assert json.loads((run_dir / "status.json").read_text())["state"] == "dead"
    finally:
        if first.poll() is None:
            first.kill()
    saved = latest_iteration(run_dir / "checkpoints")

    started = time.monotonic()  # 3. resumed over the dead run's lock, with a changed setting shown
    resumed = run_to_end(run_dir, *flags, "--lr", "1e-3", timeout_s=600)
    resume_s = time.monotonic() - started
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"taking over {run_dir} from a run that is gone" in resumed.stderr
    assert "optimizer.lr: 0.0005 -> 0.001" in resumed.stderr and "config_history/attempt-1.yaml" in resumed.stderr
    rollout_ids = [r["rollout_id"] for r in records(run_dir)]
    assert rollout_ids == list(range(60)), rollout_ids  # nothing lost, nothing twice
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*"))
    assert kept == [iteration_dir("", 54).name, iteration_dir("", 59).name]  # checkpoint.keep_last 2
    assert not (run_dir / "run.lock").exists()
    gone_within(run_dir, 10)

    started = time.monotonic()  # 4. a finished run dir: nothing to do, nothing started
    trainer_log = (run_dir / "logs" / "trainer.log").stat().st_size
    again = run_to_end(run_dir, *flags, "--lr", "1e-3", timeout_s=120)
    again_s = time.monotonic() - started
    assert again.returncode == 0 and "nothing to do" in again.stdout and "Nothing was started" in again.stdout
    assert (run_dir / "logs" / "trainer.log").stat().st_size == trainer_log
    assert not (run_dir / "config_history" / "attempt-2.yaml").exists()
    print(f"\nrefused in {refused_s:.1f} s; after SIGKILL of the driver every process gone in {cleaned_s:.1f} s; "
          f"status said dead in {status_s:.1f} s; "
          f"resumed from rollout {saved} and finished in {resume_s:.1f} s; 'nothing to do' in {again_s:.1f} s")


def test_a_hanging_reward_times_out_and_sigterm_saves_and_stops_within_seconds(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "hang"
    hang_file = tmp_path / "hang-started"
    monkeypatch.setenv("HPC_RL_TEST_HANG_FILE", str(hang_file))
    flags = ("--num-rollout", "20", "--set", "eval.eval_interval=null", "--custom-rm-path", HANGING_REWARD)

    failed = run_to_end(run_dir, *flags, "--reward-timeout", "3", timeout_s=600)  # 1. the timeout ends it
    output = failed.stdout + failed.stderr
    assert failed.returncode == 1, output[-3000:]
    assert f"custom_rm_path '{HANGING_REWARD}' (per sample)" in output
    named = re.search(r"reward failed for sample index (\d+)", output)
    assert named is not None and 256 <= int(named.group(1)) < 384, output[-3000:]  # a sample of the 3rd rollout
    assert "RewardTimeout: no reward after 3 s (rollout.reward_timeout)" in output
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    hang_to_end = time.time() - float(hang_file.read_text())
    gone_within(run_dir, 10)

    hang_file.unlink()  # 2. the same hang, with the default timeout: status answers, SIGTERM saves and stops
    process = start_run(run_dir, *flags)
    try:
        wait_for(hang_file.exists, 300, "the reward to hang")
        time.sleep(1.0)
        started = time.monotonic()
        live = subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir), "--json"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60)
        status_s = time.monotonic() - started
        assert json.loads(live.stdout)["source"] == "controller (live)", live.stdout[-500:]  # old: "not running"
        os.kill(process.pid, signal.SIGTERM)
        signalled = time.monotonic()
        code = process.wait(60)
        stop_s = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    output = (run_dir.parent / "hang.out").read_text()
    assert code == 130, output[-3000:]
    assert "checkpoint of rollout 1 saved" in output, output[-3000:]
    assert "Traceback" not in output and "which is not running" not in output
    assert latest_iteration(run_dir / "checkpoints") == 1
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
    gone_within(run_dir, 10)
    # the save must end within the grace (TERM_GRACE_LOCAL_S) or is given up; then the steps stop (the
    # trainer on its stop command, the engine and router on SIGTERM, each bounded)
    assert stop_s < TERM_GRACE_LOCAL_S + 15.0
    print(f"\nreward timeout (3 s) ended the run {hang_to_end:.1f} s after the hang began; during the hang status "
          f"answered live in {status_s:.1f} s; SIGTERM saved rollout 1 and the run exited {stop_s:.1f} s after it")


def test_a_nan_loss_is_named_and_stops_the_run_after_max_nonfinite_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "nan"
    started = time.monotonic()
    done = run_to_end(run_dir, "--num-rollout", "20", "--set", "eval.eval_interval=null", "--loss-type",
                      "custom_loss", "--custom-loss-function-path", "tests/integration/plugins/nan_loss.py:loss",
                      "--max-nonfinite-steps", "1", timeout_s=600)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]  # old: 0, "finished", having trained nothing after rollout 0
    assert "rollout 2, optimizer step 1 of 1: loss nan, grad_norm nan; the step was skipped (2 in a row, " \
           "training.max_nonfinite_steps=1): stopping" in output, output[-3000:]
    assert "step skipped (NaN/inf)" in output  # the progress line of rollout 1 said so
    assert [r["rollout_id"] for r in records(run_dir)] == [0, 1]
    assert "probability tensor" not in (run_dir / "logs" / "engine-0.log").read_text()
    gone_within(run_dir, 10)
    print(f"\nNaN loss from rollout 1: named at once, the run stopped at rollout 2, {elapsed:.1f} s after submit")
