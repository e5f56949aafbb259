"""Issue 26: weight syncs through the shared filesystem (slime's --update-weight-transport disk): a real local run
(controller, router, CPU engine, torchrun trainer rank) whose engines get every version from an HF directory the
trainer writes, with slime's post-write hook, and no weight-update group."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.run_helpers import records, run_to_end

pytestmark = pytest.mark.slow


def test_a_run_syncs_its_engines_through_the_disk(tmp_path: Path) -> None:
    run_dir, weights = tmp_path / "run", tmp_path / "weights"
    result = run_to_end(run_dir, "--num-rollout", "2", "--eval-interval", "100", "--update-weight-transport", "disk",
                        "--update-weight-disk-dir", str(weights), "--custom-update-weight-post-write-path",
                        "tests.unit.plugin_fixtures.record_post_write")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rollouts = records(run_dir)
    assert [r["metrics"]["rollout/weight_version"] for r in rollouts] == [1, 2]
    assert set(rollouts[1]["weight_versions_first_token"]) == {1}  # rollout 1 was generated with v1, from disk
    assert sorted(p.name for p in weights.iterdir()) == ["weights_v000002"]  # the previous version removed
    assert (weights / "weights_v000002" / "model.safetensors").is_file()
    hook_lines = (run_dir / "post_write.log").read_text().splitlines()
    assert hook_lines == [f"{weights / 'weights_v000001'} 1 True", f"{weights / 'weights_v000002'} 1 True"]
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert f"weights v1 -> 1 engine(s) through {weights / 'weights_v000001'}" in controller_log
    assert "bucket(s)" not in controller_log  # no broadcast over a weight-update group
