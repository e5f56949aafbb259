"""Print the requirements of hpc_rl (from setup.cfg) that the running interpreter does not satisfy.

Owns: the quick "what is missing" check behind tools/setup_env.sh. It reads installed distributions'
metadata only (no imports of torch or the other packages), so it costs about as much as starting
Python: the test and run commands stay as fast to start when everything is already installed.

    python tools/missing_requirements.py [EXTRA ...]     # e.g. `test`; one unmet requirement per line
"""

from __future__ import annotations

import configparser
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has pip (which vendors packaging) and nothing else
    from pip._vendor.packaging.requirements import Requirement

SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"


def declared_requirements(extras: list[str]) -> list[str]:
    """install_requires plus the named extras_require groups, as requirement strings."""
    parser = configparser.ConfigParser()
    parser.read(SETUP_CFG)
    lines = parser.get("options", "install_requires").splitlines()
    for extra in extras:
        if not parser.has_option("options.extras_require", extra):
            raise SystemExit(f"{SETUP_CFG}: no extra named {extra!r} in [options.extras_require]")
        lines += parser.get("options.extras_require", extra).splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def unmet(requirement_text: str) -> bool:
    requirement = Requirement(requirement_text)
    if requirement.marker is not None and not requirement.marker.evaluate():
        return False
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return True
    return not requirement.specifier.contains(installed, prereleases=True)


def main(argv: list[str]) -> int:
    for requirement_text in declared_requirements(argv):
        if unmet(requirement_text):
            print(requirement_text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
