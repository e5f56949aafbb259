"""Shared fixtures: repository paths and the shipped tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TEST_DATA = REPO_ROOT / "tests" / "unit" / "data"  # public data samples the tests read (README there)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen3 checkpoint shipped in assets/ (made by tools/make_tiny_model.py)."""
    return REPO_ROOT / "assets" / "tiny_qwen3"


@pytest.fixture()
def in_repo(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test from the repository root (configs use repo-relative paths)."""
    monkeypatch.chdir(REPO_ROOT)
    return REPO_ROOT
