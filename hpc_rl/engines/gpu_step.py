"""`python -m hpc_rl.engines.gpu_step --base-gpu-id B --tp-size T --report FILE -- ENGINE ARGV...`

Owns the first moment of every engine step: read back which GPUs Slurm gave the step (`SLURM_STEP_GPUS`,
else `CUDA_VISIBLE_DEVICES`) on which node (`SLURMD_NODENAME`), check that the positions the engine will
use (SGLang's `--base-gpu-id` B .. B+T-1) exist in that list, write what it found to FILE (JSON: node,
the step's GPU ids, `CUDA_VISIBLE_DEVICES`, base GPU id, the engine's device identities; the driver
registers the engine with them and the controller pairs colocated trainer ranks by them), put the first
identity in `HPC_RL_DEVICE_ID` (the CPU engine's weight-group duplicate check and IPC twin read it), and
`exec` the engine: same process, same pid, nothing left between srun and the engine.

A placement that cannot work (the step holds fewer GPUs than planned) exits 2 with the reason, before
the engine loads anything. Standard library only (plus hpc_rl's torch-free identity module): it runs in
every engine step, also inside a container.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_rl.weights.device_identity import (
    DEVICE_ID_ENV,
    PlacementError,
    engine_devices,
    node_name,
    step_gpu_ids,
)


def placement_report(base_gpu_id: int, tp_size: int, environ: Mapping[str, str]) -> dict[str, Any]:
    """What this step holds and which GPUs the engine uses (PlacementError if they are not there)."""
    return {"node": node_name(environ), "step_gpus": step_gpu_ids(environ),
            "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"), "base_gpu_id": base_gpu_id,
            "tp_size": tp_size, "devices": engine_devices(base_gpu_id, tp_size, environ)}


PLACEMENT_DIR = "placement"
"""In the run dir: one report per engine step, `engine-<i>.json`."""


def engine_report_path(run_dir: str | Path, index: int) -> Path:
    return Path(run_dir) / PLACEMENT_DIR / f"engine-{index}.json"


def read_report(path: str | Path) -> dict[str, Any]:
    """A report written by this module."""
    report = json.loads(Path(path).read_text())
    if not isinstance(report, dict) or not isinstance(report.get("devices"), list):
        raise ValueError(f"{path}: not an engine placement report")
    return report


def reported_devices(run_dir: str | Path, index: int) -> list[str]:
    """Engine `index`'s devices from its report ([] when its step wrote none: an engine started by hand);
    the controller registers the engine with them."""
    path = engine_report_path(run_dir, index)
    if not path.exists():
        return []
    return [str(device) for device in read_report(path)["devices"]]


def main(argv: list[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if "--" not in arguments:
        print("usage: python -m hpc_rl.engines.gpu_step --base-gpu-id B --tp-size T --report FILE -- ENGINE ARGV",
              file=sys.stderr)
        return 2
    split = arguments.index("--")
    parser = argparse.ArgumentParser(prog="python -m hpc_rl.engines.gpu_step")
    parser.add_argument("--base-gpu-id", type=int, required=True)
    parser.add_argument("--tp-size", type=int, required=True)
    parser.add_argument("--report", required=True)
    options = parser.parse_args(arguments[:split])
    engine = arguments[split + 1:]
    if not engine:
        parser.error("no engine command after --")
    try:
        report = placement_report(options.base_gpu_id, options.tp_size, os.environ)
    except PlacementError as error:
        print(f"hpc_rl: engine placement: {error}", file=sys.stderr, flush=True)
        return 2
    path = Path(options.report)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(report, indent=1) + "\n")
    temporary.replace(path)
    environ = {**os.environ, DEVICE_ID_ENV: report["devices"][0]}
    sys.stdout.flush()
    os.execvpe(engine[0], engine, environ)
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
