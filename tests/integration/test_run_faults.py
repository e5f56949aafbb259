"""Faults a user can cause, on whole local runs (controller, sglang-router, CPU engine, torchrun rank):
each ends the run quickly with a message naming the cause, and leaves no process behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

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
