"""`python -m hpc_rl.launch.install_check`: import every module of the installed hpc_rl package.

Owns the check that an installed copy (a wheel, a container image's `pip install .`) is whole: every
subpackage shipped and every module importable with the environment's packages. It prints where hpc_rl was
imported from and how many modules imported (`--json`: which ones), and exits 1 naming each module that failed
and why. It does not check the GPU path (tools/gpu_check.py does) nor versions (test_gpu_environment.py does).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import traceback


def package_modules() -> list[str]:
    """Every module and subpackage under hpc_rl, as the installed copy has them."""
    import hpc_rl

    names = ["hpc_rl"]
    for module in pkgutil.walk_packages(hpc_rl.__path__, "hpc_rl.", onerror=names.append):
        names.append(module.name)
    return names


def import_failures(names: list[str]) -> dict[str, str]:
    """{module: the last line of its import error} for each of `names` that does not import."""
    failures = {}
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001 - SystemExit from a bad __main__ is a failure too
            failures[name] = traceback.format_exception_only(type(error), error)[-1].strip()
    return failures


def main(argv: list[str] | None = None) -> int:
    """`--json`: print {"file", "modules", "failures"} as one JSON line (for tests) instead of a summary."""
    import hpc_rl

    names = package_modules()
    failures = import_failures(names)
    if "--json" in (sys.argv[1:] if argv is None else argv):
        print(json.dumps({"file": hpc_rl.__file__, "modules": names, "failures": failures}))
        return 1 if failures else 0
    print(f"hpc_rl from {hpc_rl.__file__}: {len(names) - len(failures)} of {len(names)} modules import")
    for name, error in failures.items():
        print(f"  {name}: {error}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
