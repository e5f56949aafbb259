"""The run's own files: rollouts.jsonl after a resume keeps only the rollouts before the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rl.telemetry.run_files import drop_rollout_records_from


def test_resume_drops_the_records_of_the_rollouts_it_redoes(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    lines = [json.dumps({"rollout_id": i, "metrics": {}}) for i in range(5)]
    path.write_text("\n".join(lines) + '\n{"rollout_id": 5, "metr')  # the stopped attempt, cut mid-line
    assert drop_rollout_records_from(path, 3) == 3
    assert [json.loads(line)["rollout_id"] for line in path.read_text().splitlines()] == [0, 1, 2]
    assert drop_rollout_records_from(path, 3) == 0
    assert drop_rollout_records_from(tmp_path / "missing.jsonl", 0) == 0
