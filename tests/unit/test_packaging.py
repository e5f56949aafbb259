"""The setup config ships all of hpc_rl: every directory of modules is a package `packages = find:` finds,
and every data file the code reads next to itself is package data (tests/integration/test_wheel_install.py
builds and installs the wheel itself)."""

from __future__ import annotations

import configparser
import fnmatch
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    return parser


def found_packages() -> set[str]:
    include = [line.strip() for line in setup_cfg()["options.packages.find"]["include"].replace(",", "\n").split()
               if line.strip()]
    return set(find_packages(str(REPO), include=include))


def module_directories() -> set[str]:
    """Every directory under hpc_rl/ holding .py files, as a dotted package name."""
    return {".".join(path.parent.relative_to(REPO).parts) for path in (REPO / "hpc_rl").rglob("*.py")}


def test_every_directory_of_modules_is_a_package_the_setup_config_finds() -> None:
    missing = sorted(module_directories() - found_packages())
    assert not missing, f"not in the wheel (add an __init__.py with the package's docstring): {missing}"


def test_every_data_file_under_hpc_rl_is_package_data() -> None:
    patterns: dict[str, list[str]] = {}
    for line in setup_cfg()["options.package_data"].items():
        package, globs = line
        patterns[package] = [glob.strip() for glob in globs.split(",") if glob.strip()]
    data_files = [path for path in (REPO / "hpc_rl").rglob("*") if path.is_file()
                  and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts]
    assert data_files, "hpc_rl/config's option lists are read at run time: this test must see them"
    unshipped = [str(path.relative_to(REPO)) for path in data_files
                 if not any(fnmatch.fnmatch(path.name, glob)
                            for glob in patterns.get(".".join(path.parent.relative_to(REPO).parts), []))]
    assert not unshipped, f"add to [options.package_data] in setup.cfg: {unshipped}"


def test_the_container_image_imports_every_module_of_its_installed_copy() -> None:
    for recipe in ("gpu.Dockerfile", "hpc_rl-gpu.def"):
        assert "python3 -m hpc_rl.launch.install_check" in (REPO / "containers" / recipe).read_text(), recipe
