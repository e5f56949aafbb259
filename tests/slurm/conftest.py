"""Fixtures of the Slurm tests: skip without a cluster; a fresh run dir (and submitit folder) per test."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    return subprocess.run(["sinfo", "-h"], check=False, capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="session", autouse=True)
def _need_slurm() -> None:
    if not slurm_answers():
        pytest.skip("no reachable Slurm cluster (tools/local_slurm.sh up starts one)")


@pytest.fixture()
def run_dir(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A new run dir under the repo's runs/ (every virtual node sees it; job ids may repeat after a reset)."""
    monkeypatch.chdir(REPO)  # the job's working directory: configs and tests.* resolve from here
    path = REPO / "runs" / "slurm-tests" / uuid.uuid4().hex[:10]
    path.mkdir(parents=True)
    return path
