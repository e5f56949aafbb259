"""A short async run with in-place weight updates (rollout.flush_cache_interval 2; issue 34 item 1): real controller,
router, CPU engine and trainer rank. Every second sync flushes the engines' cache, the others pause in place; each
synced version is served; no trained token is more than one version behind. (How many samples span two versions
depends on where the sync lands in the generation: measured by benchmarks/bench_in_place_updates.py, not asserted.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.run_helpers import records, run_to_end

pytestmark = pytest.mark.slow


def test_async_in_place_updates_flush_every_second_sync(tmp_path: Path) -> None:
    run_dir = tmp_path / "in-place"
    result = run_to_end(run_dir, "--num-rollout", "4", "--eval-interval", "100", "--async-rollout",
                        "--max-staleness", "1", "--flush-cache-interval", "2", timeout_s=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3]
    assert [r["metrics"]["rollout/weight_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [r["metrics"]["weight_sync/flushed_cache"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    for trained_at, row in enumerate(rows):
        assert len(row["sample_indices"]) == 16 * 8 == len(set(row["sample_indices"]))
        assert max(trained_at - v for v in row["weight_versions_first_token"]) <= 1
        assert "rollout/samples_spanning_versions" in row["metrics"]  # the mix, measured per rollout
