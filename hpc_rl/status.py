"""`python -m hpc_rl.status RUN_DIR`: what a run is doing, from its controller, its files and Slurm.

Owns: asking the live controller (StatusRequest over the authenticated protocol, address from
`<run_dir>/controller.address`), falling back to the last `status.json` the controller wrote, and
adding Slurm's view (`squeue`/`sacct`) when the run was submitted to Slurm; printing it readably
(or as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hpc_rl.controller.app import CONTROLLER_ADDRESS_FILE
from hpc_rl.protocol import BlockingClient, Hello, load_secret, secret_path
from hpc_rl.protocol.messages import StatusReply, StatusRequest


def live_status(run_dir: Path, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The running controller's status, or None when it does not answer."""
    address_file = run_dir / CONTROLLER_ADDRESS_FILE
    if not address_file.is_file():
        return None
    host, port = address_file.read_text().strip().rsplit(":", 1)
    try:
        with BlockingClient(host, int(port), load_secret(secret_path(run_dir)), hello=Hello(role="status"),
                            timeout=timeout_s) as client:
            reply = client.request(StatusRequest())
    except (OSError, RuntimeError, ValueError):
        return None
    return reply.status if isinstance(reply, StatusReply) else None


def collect_status(run_dir: Path) -> dict[str, Any]:
    status = live_status(run_dir)
    source = "controller (live)"
    if status is None:
        saved = run_dir / "status.json"
        status = json.loads(saved.read_text()) if saved.is_file() else {}
        source = "status.json (controller not running)" if status else "nothing yet"
    status["source"] = source
    from hpc_rl.launch.slurm_status import describe_slurm_status, read_job_id

    if read_job_id(run_dir) is not None:
        status["slurm"] = describe_slurm_status(run_dir)
    return status


def format_status(status: dict[str, Any]) -> str:
    lines = [f"run dir: {status.get('run_dir', '?')}   (source: {status['source']})"]
    if "rollout_id" in status:
        lines.append(f"rollout {status['rollout_id']}/{status.get('num_rollout', '?')}, weight version "
                     f"{status.get('weight_version')}, partial buffer {status.get('buffer_size')} group(s)")
    if status.get("reward_mean") is not None:
        lines.append(f"last rollout: reward {status['reward_mean']:.3f}, {status.get('last_rollout_seconds') or 0:.2f} s, "
                     f"{status.get('samples_per_second') or 0:.1f} samples/s")
    components = status.get("components", {})
    for rank, trainer in components.get("trainers", {}).items():
        lines.append(f"trainer rank {rank}: pid {trainer['pid']} on {trainer['host']}")
    for index, engine in components.get("engines", {}).items():
        extra = f", restarts {engine['restarts']}" if engine.get("restarts") else ""
        lines.append(f"engine {index}: {engine['state']} at {engine['url']}{extra}")
    if status.get("slurm"):
        lines.append(f"slurm: {status['slurm']}")
    if status.get("last_error"):
        lines.append(f"last error: {status['last_error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Show the status of an hpc_rl run.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")
    args = parser.parse_args(argv)
    if not (args.run_dir / "config.resolved.yaml").is_file():
        print(f"hpc_rl.status: {args.run_dir} is not a run directory (no config.resolved.yaml)", file=sys.stderr)
        return 2
    status = collect_status(args.run_dir)
    print(json.dumps(status, indent=1, default=str) if args.json else format_status(status))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
