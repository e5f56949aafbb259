"""Faults a user can cause, on whole local runs (controller, sglang-router, CPU engine, torchrun rank):
each ends the run quickly with a message naming the cause, and leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from hpc_rl.training.checkpoint import latest_iteration, resolve_checkpoint_dir
from tests.integration.run_helpers import processes_mentioning, run_to_end

pytestmark = pytest.mark.slow


def test_a_sampling_value_the_engine_rejects_ends_the_run_with_its_message(tmp_path: Path) -> None:
    run_dir = tmp_path / "bad-temperature"
    started = time.monotonic()
    done = run_to_end(run_dir, "--num-rollout", "3", "--set",
                      "rollout.custom_generate_function_path=tests/integration/plugins/negative_temperature.py:generate",
                      timeout_s=600)  # the old code dropped groups for many minutes: this timed out
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "the engine rejected a generation request as invalid (HTTP 400)" in output, output[-3000:]
    assert "temperature must be a non-negative finite number, got -3.0." in output  # the engine's (SGLang's) words
    assert "'temperature': -3.0" in output
    assert processes_mentioning(str(run_dir)) == []
    print(f"run ended {elapsed:.0f} s after submit")


def test_a_full_disk_while_checkpointing_is_named_and_the_last_checkpoint_kept(tmp_path: Path) -> None:
    full = tmp_path / "small-disk"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(full)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a 2 MiB tmpfs here (needs root)")
    run_dir = tmp_path / "disk-full"
    try:
        # A tiny checkpoint is ~1.2 MiB: the first fits on the 2 MiB disk, the second does not.
        done = run_to_end(run_dir, "--num-rollout", "3", "--set", "checkpoint.save_interval=1",
                          "--set", f"checkpoint.save={full}/checkpoints", "--eval-interval", "1000", timeout_s=600)
        output = done.stdout + done.stderr
        assert done.returncode == 1, output[-3000:]
        assert f"no space left on {full}/checkpoints" in output, output[-3000:]  # old: "rank 0 disconnected"
        assert "Logging error" not in output
        checkpoints = full / "checkpoints"
        assert not list(checkpoints.glob("*.tmp")), sorted(p.name for p in checkpoints.iterdir())
        kept = resolve_checkpoint_dir(checkpoints)
        assert json.loads((kept / "hpc_rl_state.json").read_text())["rollout_id"] == latest_iteration(checkpoints)
        assert (kept / ".metadata").is_file()
        assert processes_mentioning(str(run_dir)) == []
        print(output[-1500:])
    finally:
        subprocess.run(["umount", str(full)], check=False)


def test_run_records_agree_and_rerunning_a_finished_run_dir_says_nothing_was_done(tmp_path: Path) -> None:
    from tests.integration.test_run_local import tensorboard_scalars

    run_dir = tmp_path / "records"
    flags = ("--num-rollout", "2", "--set", "eval.eval_interval=null")
    first = run_to_end(run_dir, *flags, timeout_s=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "eval" not in first.stdout  # eval_interval null: no eval, not even before training (old: one ran)
    assert not tensorboard_scalars(run_dir, "eval/tiny_copy/reward_mean")
    # Both count finished rollouts (old: train/* from the trainer started at 0, rollout/* at 1); train/* is the
    # trainer's alone, one point per optimizer step (old: the controller wrote its per-rollout summary too).
    assert tensorboard_steps(run_dir, "train/pg_loss") == [1, 2]
    assert tensorboard_steps(run_dir, "rollout/reward_mean") == [1, 2]
    assert (run_dir / "logs/router.log").read_text().startswith("hpc_rl: sglang-router at http://127.0.0.1:")

    again = run_to_end(run_dir, *flags, timeout_s=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "nothing to do: the checkpoint in" in again.stdout and "is already at rollout 2 of 2" in again.stdout
    assert [json.loads(line)["rollout_id"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()] == [0, 1]


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: list[int] = []
    for events in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags().get("scalars", []):
            steps += [event.step for event in accumulator.Scalars(tag)]
    return sorted(steps)
