"""The seed launch lines of issue 10 and vime's of issue 25 (stored in tests/unit/data/slime_launch_lines) as argv
lists, and the resolved config a dry run prints."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

LINES_DIR = Path(__file__).resolve().parent / "data" / "slime_launch_lines"


def flags_of(file_name: str) -> list[str]:
    """One file's flags as bash would expand ${X_ARGS[@]} (comments dropped)."""
    return shlex.split((LINES_DIR / file_name).read_text(), comments=True)


def seeds(seeds_file: str = "seeds.yaml") -> dict[str, dict[str, Any]]:
    return yaml.safe_load((LINES_DIR / seeds_file).read_text())


def seed_argv(name: str, seeds_file: str = "seeds.yaml") -> list[str]:
    seed = seeds(seeds_file)[name]
    argv = shlex.split(seed["head"])
    for file_name in seed["files"]:
        argv += flags_of(file_name)
    return argv


def config_field(config: Any, path: str) -> Any:
    """`config.cluster.colocate` for 'cluster.colocate' (any depth)."""
    for part in path.split("."):
        config = getattr(config, part)
    return config


def resolved_from_dry_run(output: str) -> dict[str, Any]:
    """The resolved config `python -m hpc_rl.submit ... --dry-run` printed."""
    text = output.split("# resolved config\n", 1)[1].split("# executor:", 1)[0]
    return yaml.safe_load(text)
