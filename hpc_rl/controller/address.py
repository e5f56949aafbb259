"""Where a run's controller listens, as a file in the run dir (read by `python -m hpc_rl.status`).

Owns: the file's name and format (`host:port`). Kept apart from `app` so that readers import a
constant, not the controller.
"""

from __future__ import annotations

from pathlib import Path

CONTROLLER_ADDRESS_FILE = "controller.address"
"""host:port of the running controller, in the run dir."""


def write_controller_address(run_dir: Path, host: str, port: int) -> None:
    (run_dir / CONTROLLER_ADDRESS_FILE).write_text(f"{host}:{port}\n")
