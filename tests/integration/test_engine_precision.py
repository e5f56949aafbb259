"""Engine and trainer agree on dtype, and a run whose engines do not fails loudly (issue 22 item 5).

The driver starts every engine with the dtype the trainer exports (float32 on CPU: the CPU engine's
`--dtype`, SGLang's `--dtype`); validation refuses another `sglang.dtype` at submit. Here the resolved config
is edited after validation, as a site's wrapper or a stale config could, so the CPU engine serves bfloat16
while the trainer trains float32: the first rollout generated right after a sync shows the gap and the run
stops with the controller's LogprobMismatch (SGLang's `auto` dtype serving a float32 checkpoint in float16
was this bug on real SGLang: a gap of 2.8e-4 per token instead of ~1e-7).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.run_helpers import REPO_ROOT, processes_mentioning, records

pytestmark = pytest.mark.slow


def test_engines_serving_another_dtype_than_the_trainer_fail_the_run_after_the_first_sync(tmp_path: Path) -> None:
    run_dir = tmp_path / "bf16-engine"
    prepared = subprocess.run([sys.executable, "-m", "hpc_rl.launch.prepare_run", "configs/tiny_cpu.yaml",
                               "--run-dir", str(run_dir), "--num-rollout", "6", "--eval-interval", "1000"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    resolved = run_dir / "config.resolved.yaml"
    config = yaml.safe_load(resolved.read_text())
    config["sglang"]["extra_args"] = {"dtype": "bfloat16"}
    resolved.write_text(yaml.safe_dump(config, sort_keys=False))
    driver = subprocess.run([sys.executable, "-m", "hpc_rl.launch.driver", "--run-dir", str(run_dir)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert driver.returncode == 1, driver.stdout[-2000:] + driver.stderr[-2000:]
    assert "LogprobMismatch" in driver.stderr or "log-probs differ" in driver.stderr, driver.stderr[-2000:]
    assert "right after weight sync v1" in driver.stderr and "controller.max_logprob_mismatch" in driver.stderr
    assert [r["rollout_id"] for r in records(run_dir)] == [0]  # rollout 1, the first after a sync, stopped it
    assert processes_mentioning(str(run_dir)) == []
