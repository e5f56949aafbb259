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
    assert "temperature must be >= 0" in output  # the engine's own words
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
