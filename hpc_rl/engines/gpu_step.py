"""`python -m hpc_rl.engines.gpu_step --base-gpu-id B --tp-size T --report FILE -- ENGINE ARGV...`

Owns the first moment of every engine step: read back which GPUs Slurm gave the step (`SLURM_STEP_GPUS`,
else `CUDA_VISIBLE_DEVICES`) on which node (`SLURMD_NODENAME`), check that the positions the engine will
use (SGLang's `--base-gpu-id` B .. B+T-1) exist in that list, write what it found to FILE (JSON: node,
the step's GPU ids, `CUDA_VISIBLE_DEVICES`, base GPU id, the engine's device identities; the driver
registers the engine with them and the controller pairs colocated trainer ranks by them), put the first
identity in `HPC_RL_DEVICE_ID` (the CPU engine's weight-group duplicate check and IPC twin read it), and
`exec` the engine: same process, same pid, nothing left between srun and the engine.

A multi-node engine (`--nnodes N --node-hosts H0,.. --node-ports P0,..`) runs one task per node: each reads
its node-rank from its task rank (`SLURM_PROCID`; `NODE_RANK_ENV` when started by hand), holds TP ranks
k*T .. k*T+T-1 (T = `--tp-size`, the GPUs per node), writes its report beside node-rank 0's
(`engine-<i>.node<k>.json`), and gives the engine its own `--host`, `--port` and `--node-rank` (SGLang's
follower nodes serve their health endpoints there; node-rank 0 the API).

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


NODE_RANK_ENV = "HPC_RL_NODE_RANK"
"""The node-rank of a multi-node engine's process started by hand (tests); on Slurm it is the task rank."""


def placement_report(base_gpu_id: int, tp_size: int, environ: Mapping[str, str], *, nnodes: int = 1,
                     node_rank: int = 0) -> dict[str, Any]:
    """What this step holds and which GPUs the engine uses (PlacementError if they are not there); a
    multi-node engine's node-rank k reports its T GPUs, TP ranks k*T .. k*T+T-1."""
    return {"node": node_name(environ), "step_gpus": step_gpu_ids(environ),
            "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"), "base_gpu_id": base_gpu_id,
            "tp_size": tp_size, "nnodes": nnodes, "node_rank": node_rank,
            "devices": engine_devices(base_gpu_id, tp_size, environ)}


def node_rank_of(environ: Mapping[str, str]) -> int:
    """This task's node-rank in a multi-node engine step (one task per node)."""
    return int(environ.get(NODE_RANK_ENV) or environ.get("SLURM_PROCID") or 0)


def with_node_rank(engine: list[str], node_rank: int, host: str, port: int) -> list[str]:
    """The engine's argv for node-rank `node_rank`: its own `--host` and `--port`, and `--node-rank`."""
    argv = list(engine)
    for flag, value in (("--host", host), ("--port", str(port))):
        if flag in argv and argv.index(flag) + 1 < len(argv):
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return [*argv, "--node-rank", str(node_rank)]


PLACEMENT_DIR = "placement"
"""In the run dir: one report per engine step, `engine-<i>.json` (a multi-node engine's other node-ranks:
`engine-<i>.node<k>.json`)."""


def engine_report_path(run_dir: str | Path, index: int, node_rank: int = 0) -> Path:
    suffix = f".node{node_rank}" if node_rank else ""
    return Path(run_dir) / PLACEMENT_DIR / f"engine-{index}{suffix}.json"


def node_report_path(report: str | Path, node_rank: int) -> Path:
    """Node-rank k's report beside node-rank 0's `report`."""
    path = Path(report)
    return path if node_rank == 0 else path.with_name(f"{path.stem}.node{node_rank}{path.suffix}")


def read_report(path: str | Path) -> dict[str, Any]:
    """A report written by this module."""
    report = json.loads(Path(path).read_text())
    if not isinstance(report, dict) or not isinstance(report.get("devices"), list):
        raise ValueError(f"{path}: not an engine placement report")
    return report


def reported_devices(run_dir: str | Path, index: int) -> list[str]:
    """Engine `index`'s devices from its report ([] when its step wrote none: an engine started by hand),
    in TP-rank order over all its node-ranks; the controller registers the engine with them."""
    path = engine_report_path(run_dir, index)
    if not path.exists():
        return []
    first = read_report(path)
    devices = [str(device) for device in first["devices"]]
    for node_rank in range(1, int(first.get("nnodes") or 1)):
        other = node_report_path(path, node_rank)
        if not other.exists():
            raise ValueError(f"engine {index} spans {first['nnodes']} nodes but node-rank {node_rank} wrote no "
                             f"placement report ({other}): see the engine's log")
        devices += [str(device) for device in read_report(other)["devices"]]
    return devices


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
    parser.add_argument("--nnodes", type=int, default=1, help="nodes the engine spans (one task per node)")
    parser.add_argument("--node-hosts", default="", help="each node-rank's address, comma-separated")
    parser.add_argument("--node-ports", default="", help="each node-rank's port, comma-separated")
    options = parser.parse_args(arguments[:split])
    engine = arguments[split + 1:]
    if not engine:
        parser.error("no engine command after --")
    node_rank = node_rank_of(os.environ) if options.nnodes > 1 else 0
    if options.nnodes > 1:
        hosts, ports = options.node_hosts.split(","), options.node_ports.split(",")
        if not 0 <= node_rank < options.nnodes or len(hosts) != options.nnodes or len(ports) != options.nnodes:
            print(f"hpc_rl: engine placement: node-rank {node_rank} of {options.nnodes}, with {len(hosts)} host(s) "
                  f"and {len(ports)} port(s): the step must run one task on each of its {options.nnodes} nodes",
                  file=sys.stderr, flush=True)
            return 2
        engine = with_node_rank(engine, node_rank, hosts[node_rank], int(ports[node_rank]))
    try:
        report = placement_report(options.base_gpu_id, options.tp_size, os.environ, nnodes=options.nnodes,
                                  node_rank=node_rank)
    except PlacementError as error:
        print(f"hpc_rl: engine placement: {error}", file=sys.stderr, flush=True)
        return 2
    path = node_report_path(options.report, node_rank)
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
