"""A real local run from a slime-style launch line alone (Megatron model flags, no YAML file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.config.model import ModelArchitecture
from tests.integration.run_helpers import REPO_ROOT, records
from tests.unit.slime_lines import flags_of

pytestmark = pytest.mark.slow


def test_flags_only_run_trains_with_the_flag_architecture(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hpc_rl.submit", *flags_of("tiny_qwen3_model_args.txt"),
            *flags_of("tiny_cpu_rest.txt"), "--executor", "local", "--run-dir", str(run_dir)]
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(records(run_dir)) == 2
    arch = ModelArchitecture.from_yaml(run_dir / "model.yaml")
    assert (arch.num_layers, arch.hidden_size, arch.family) == (2, 64, "qwen3")
