"""The wheel is the whole package: built from a copy of the checkout's setup files and hpc_rl/, installed
non-editable into a fresh venv, and run from a directory outside the checkout, every module imports and
`python -m hpc_rl.submit` answers --help and a recipe's --dry-run (issue 29 item 6).

The fresh venv sees this interpreter's packages (torch, megatron-core, ... are not reinstalled: no network) through
.pth lines naming its site directories, placed after the venv's own; `python -m venv --system-site-packages` alone
would give the base interpreter's, not this venv's. The checkout's editable hpc_rl install is a meta-path finder
that the .pth line does not load, and PYTHONPATH is cleared, so the wheel's copy is the one imported: the test
checks `hpc_rl.__file__` is inside the fresh venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_FILES = ("setup.cfg", "setup.py", "pyproject.toml", "README.md")


def run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def build_wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    """The wheel of a clean copy (no stale build/ of the checkout can slip modules in or out)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCE_FILES:
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "hpc_rl", source / "hpc_rl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(source)], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("hpc_rl-*.whl")
    return wheel


def fresh_venv(tmp_path: Path, env: dict[str, str]) -> Path:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  tmp_path, env).stdout.strip()
    # every site directory this interpreter imports from (its venv's, and the system's under a venv made with
    # --system-site-packages), after the fresh venv's own; plain path lines: their .pth files (the editable
    # hpc_rl finder) are not run
    sites = [entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")]
    Path(purelib, "base_venv.pth").write_text("\n".join(dict.fromkeys(sites)) + "\n")
    return python


@pytest.mark.slow
def test_the_wheel_installs_and_runs_from_outside_the_checkout(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    wheel = build_wheel(tmp_path, env)
    python = fresh_venv(tmp_path, env)
    # --ignore-installed: never uninstall the editable hpc_rl this venv's pip would otherwise see
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)], tmp_path, env)

    outside = tmp_path / "elsewhere"  # a user's directory: their recipes, not the checkout
    shutil.copytree(REPO / "configs", outside / "configs")
    report = json.loads(run([str(python), "-m", "hpc_rl.launch.install_check", "--json"], outside, env)
                        .stdout.strip().splitlines()[-1])
    assert Path(report["file"]).is_relative_to(tmp_path / "venv"), report["file"]
    checkout_modules = set()
    for path in (REPO / "hpc_rl").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        checkout_modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    assert not report["failures"], report["failures"]
    assert set(report["modules"]) == checkout_modules, sorted(checkout_modules ^ set(report["modules"]))
    installed = Path(report["file"]).parent
    data_files = [path.relative_to(REPO / "hpc_rl") for path in (REPO / "hpc_rl").rglob("*")
                  if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts]
    assert data_files and all((installed / path).is_file() for path in data_files), \
        [str(path) for path in data_files if not (installed / path).is_file()]

    help_text = run([str(python), "-m", "hpc_rl.submit", "--help"], outside, env).stdout
    assert "--dry-run" in help_text
    recipe = outside / "configs" / "qwen3_4b_grpo.yaml"
    dry_run = run([str(python), "-m", "hpc_rl.submit", str(recipe), "--dry-run", "--no-check-files"], outside, env)
    assert "dry run: the config is valid" in dry_run.stdout, dry_run.stdout[-2000:]
    assert str(python) in dry_run.stdout  # the steps run the installed interpreter
