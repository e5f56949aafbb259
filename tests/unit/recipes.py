"""The recipes under configs/ and whether this tree has each one's model family (tests that walk every recipe)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


def skip_without_family(recipe: str) -> None:
    """Skip a recipe whose model file names a family this tree does not register (tiny_vl_cpu.yaml's qwen3_vl
    before issue 32's model half is merged)."""
    from hpc_rl.models.registry import family_names

    model = (yaml.safe_load((REPO / "configs" / recipe).read_text()) or {}).get("model")
    path = REPO / model if model else None
    name = (yaml.safe_load(path.read_text()) or {}).get("family") if path is not None and path.is_file() else None
    if name is not None and name not in family_names():
        pytest.skip(f"model family {name} is not registered in this tree")
