"""A short async run with in-place weight updates (rollout.flush_cache_interval 2; issue 34 item 1): real controller,
router, CPU engine and trainer rank. Every second sync flushes the engines' cache, the others pause in place; each
synced version is served; no trained token is more than one version behind. (How many samples span two versions
depends on where the sync lands in the generation: measured by benchmarks/bench_in_place_updates.py, not asserted.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpc_rl.engines.sglang_launch import SGLANG_PYTHON_ENV
from tests.integration.run_helpers import REPO_ROOT, records, run_to_end, submit_argv
from tests.integration.test_engine_conformance import SGLANG_PYTHON, SGLANG_VENV

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("answer_workers", [0, 1])  # 1: pause, update and continue are the answer worker's calls
def test_async_in_place_updates_flush_every_second_sync(tmp_path: Path, answer_workers: int) -> None:
    run_dir = tmp_path / "in-place"
    result = run_to_end(run_dir, "--num-rollout", "4", "--eval-interval", "100", "--async-rollout",
                        "--max-staleness", "1", "--flush-cache-interval", "2",
                        "--answer-parse-workers", str(answer_workers), timeout_s=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("answer worker(s))" in (run_dir / "logs" / "controller.log").read_text()) == bool(answer_workers)
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3]
    assert [r["metrics"]["rollout/weight_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [r["metrics"]["weight_sync/flushed_cache"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    for trained_at, row in enumerate(rows):
        assert len(row["sample_indices"]) == 16 * 8 == len(set(row["sample_indices"]))
        assert max(trained_at - v for v in row["weight_versions_first_token"]) <= 1
        assert "rollout/samples_spanning_versions" in row["metrics"]  # the mix, measured per rollout


@pytest.mark.sglang_cpu
@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"no SGLang CPU venv at {SGLANG_VENV}")
def test_in_place_updates_with_real_sglang_on_cpu(tmp_path: Path) -> None:
    """The same run against real SGLang 0.5.23 (CPU): its weight-update calls on an engine paused in place skip
    the model-update lock the paused requests hold (no hang), flush_cache false is taken, every second sync's
    retract + flush goes through, and each version is served."""
    run_dir = tmp_path / "in-place-sglang"
    flags = ("--num-rollout", "4", "--eval-interval", "100", "--async-rollout", "--max-staleness", "1",
             "--flush-cache-interval", "2", "--set", "rollout.engine=sglang", "--sglang-max-total-tokens", "4096")
    result = subprocess.run(submit_argv(run_dir, *flags), cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=900, env={**os.environ, SGLANG_PYTHON_ENV: str(SGLANG_PYTHON)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "server_args=" in (run_dir / "logs" / "engine-0.log").read_text()  # SGLang's start line
    rows = records(run_dir)
    assert [r["metrics"]["rollout/weight_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [r["metrics"]["weight_sync/flushed_cache"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    for trained_at, row in enumerate(rows):
        assert len(row["sample_indices"]) == 16 * 8 == len(set(row["sample_indices"]))
        assert max(trained_at - v for v in row["weight_versions_first_token"]) <= 1
    print("samples spanning versions per rollout:", [r["metrics"]["rollout/samples_spanning_versions"] for r in rows])
