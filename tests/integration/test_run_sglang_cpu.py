"""The embedded default run with real SGLang 0.5.23 on CPU as its engine (`rollout.engine: sglang` with
`cluster.device: cpu`): the engine kind is independent of the device, and the whole loop (driver, router,
controller, gloo weight sync) works against the real server. Only where tools/install_sglang_cpu.sh's venv
exists (marker `sglang_cpu`); ~3 min on an idle 2-core machine.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.engines.sglang_launch import SGLANG_PYTHON_ENV
from tests.integration.run_helpers import REPO_ROOT, processes_mentioning, records
from tests.integration.test_engine_conformance import SGLANG_PYTHON, SGLANG_VENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang_cpu,
              pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"no SGLang CPU venv at {SGLANG_VENV}")]


def test_tiny_run_learns_with_real_sglang_on_cpu(tmp_path: Path) -> None:
    run_dir = tmp_path / "sglang"
    command = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "local",
               "--run-dir", str(run_dir), "--set", "rollout.engine=sglang", "--sglang-max-total-tokens", "4096"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=2400,
                            env={**os.environ, SGLANG_PYTHON_ENV: str(SGLANG_PYTHON)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "server_args=" in (run_dir / "logs" / "engine-0.log").read_text()  # SGLang's start line, not the CPU engine
    rows = records(run_dir)
    rewards = [r["metrics"]["rollout/reward_mean"] for r in rows]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last - first >= 0.3, f"reward went {first:.3f} -> {last:.3f}"
    # SGLang serves the trainer's dtype (float32 here, passed as --dtype): after every sync its log-probs are the
    # trainer's (with its `auto` dtype it served float16: a gap of 2.8e-4; the run's guard now fails at 1e-4)
    assert "dtype='float32'" in (run_dir / "logs" / "engine-0.log").read_text()
    for row in rows[1:]:
        assert row["metrics"]["train/first_step_train_rollout_logprob_abs_diff"] < 1e-5, (row["rollout_id"], row["metrics"])
    assert processes_mentioning(str(run_dir)) == []
