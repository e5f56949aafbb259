"""`python -m hpc_rl.status RUN_DIR`: what a run is doing, from its controller, its files and Slurm.

Owns: asking the live controller (StatusRequest over the authenticated protocol, address from
`<run_dir>/controller.address`), falling back to the last `status.json` the controller wrote, and
adding Slurm's view (`squeue`/`sacct`) when the run was submitted to Slurm; whether the run still lives
(`run_lock`: the lock's holder by Slurm's job state, its pid or its heartbeat; a status.json that says
"running" with no holder left is a run that ended without recording it): a dead run is shown as
"dead since <time>" with why and the last line of its log, and its status.json is corrected (when it can
be written); printing it readably (or as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hpc_rl.controller.address import CONTROLLER_ADDRESS_FILE
from hpc_rl.launch.run_lock import Liveness, LockHolder, holder_liveness, read_lock
from hpc_rl.protocol import BlockingClient, Hello, load_secret, secret_path
from hpc_rl.protocol.messages import StatusReply, StatusRequest
from hpc_rl.telemetry.run_files import write_text_atomically


class StatusUnavailable(Exception):
    """The live controller could not be asked; the message says why (shown next to the fallback)."""


def read_controller_address(run_dir: Path) -> tuple[str, int] | None:
    """(host, port) from `<run_dir>/controller.address`; None when there is none (not started or ended)."""
    address_file = run_dir / CONTROLLER_ADDRESS_FILE
    try:
        text = address_file.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise StatusUnavailable(f"cannot read {address_file}: {error}") from None
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StatusUnavailable(f"{address_file} holds {text[:80]!r}, not host:port")
    return host, int(port)


def live_status(run_dir: Path, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The running controller's status; None when no controller address is recorded; StatusUnavailable
    (saying why) when one is recorded but asking it failed in any way."""
    address = read_controller_address(run_dir)
    if address is None:
        return None
    host, port = address
    try:
        with BlockingClient(host, port, load_secret(secret_path(run_dir)), hello=Hello(role="status"),
                            timeout=timeout_s) as client:
            reply = client.request(StatusRequest())
    except Exception as error:  # noqa: BLE001 - any failure to ask means: show the saved status instead
        raise StatusUnavailable(f"controller at {host}:{port} did not answer ({type(error).__name__}: "
                                f"{error})") from None
    if not isinstance(reply, StatusReply):
        raise StatusUnavailable(f"controller at {host}:{port} answered {reply.TYPE!r}, not a status reply")
    return reply.status


def saved_status(run_dir: Path) -> tuple[dict[str, Any], str]:
    """(the last status.json, how it was read); a missing or unreadable file gives an empty status."""
    saved = run_dir / "status.json"
    try:
        status = json.loads(saved.read_text())
    except FileNotFoundError:
        return {}, "nothing yet (no status.json)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return {}, f"{saved} is unreadable ({type(error).__name__}: {error})"
    if not isinstance(status, dict):
        return {}, f"{saved} is unreadable (a JSON {type(status).__name__}, not an object)"
    ended = status.get("state") not in (None, "running")
    return status, "status.json (run ended)" if ended else "status.json (controller not running)"


def last_log_line(run_dir: Path) -> str:
    """The last non-empty line of the run's controller log ('' if none)."""
    try:
        with open(run_dir / "logs" / "controller.log", "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 65536))
            lines = [line for line in handle.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def dead_run(run_dir: Path, status: dict[str, Any], holder: LockHolder | None,
             liveness: Liveness | None) -> dict[str, Any] | None:
    """Why and since when the run is dead although nothing recorded its end; None when it lives (its lock's
    holder does) or it ended and said so."""
    if status.get("state") not in (None, "running"):  # it ended and said so (a Slurm job's lock stays)
        return None
    if holder is not None and liveness is not None:
        if liveness.alive:
            return None
        return {"dead_since": holder.heartbeat_at, "why": f"{holder.describe()}: {liveness.why}"}
    if status.get("state") != "running":  # no holder, and nothing says it ever ran
        return None
    times = [t for t in (status.get("updated_at"), _mtime(run_dir / "logs" / "controller.log")) if t]
    return {"dead_since": max(times) if times else None,
            "why": "no process holds the run dir and status.json was not updated at its end"}


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _record_death(run_dir: Path, status: dict[str, Any]) -> None:
    """status.json says what status found (best effort: the disk may still be full)."""
    saved = {k: v for k, v in status.items() if k not in ("source", "slurm")}
    try:
        write_text_atomically(run_dir / "status.json", json.dumps(saved, indent=1, default=str))
    except OSError:
        pass


def collect_status(run_dir: Path) -> dict[str, Any]:
    why_not_live = ""
    try:
        status = live_status(run_dir)
    except StatusUnavailable as error:
        status, why_not_live = None, str(error)
    source = "controller (live)"
    if status is None:
        holder = read_lock(run_dir)
        liveness = holder_liveness(holder) if holder is not None else None
        status, source = saved_status(run_dir)
        if liveness is not None and liveness.alive:
            source = f"status.json; the run lives ({holder.describe()}; {liveness.why})"  # type: ignore[union-attr]
        if why_not_live:
            source += f"; {why_not_live}"
        dead = dead_run(run_dir, status, holder, liveness)
        if dead is not None:
            status.update(state="dead", dead_since=dead["dead_since"], dead_why=dead["why"],
                          last_log_line=last_log_line(run_dir))
            if isinstance(status.get("components"), dict):
                for engine in status["components"].get("engines", {}).values():
                    engine["state"] = "stopped"
            _record_death(run_dir, status)
            source = "status.json and the run dir's lock (the run is dead)"
            source += f"; {why_not_live}" if why_not_live else ""
    status["source"] = source
    from hpc_rl.launch.slurm_status import describe_slurm_status, read_job_id

    if read_job_id(run_dir) is not None:
        status["slurm"] = describe_slurm_status(run_dir)
    status["engine_job_list"] = engine_job_list(run_dir, status.get("engine_jobs") or {})
    return status


def engine_job_list(run_dir: Path, live: dict[str, Any]) -> list[dict[str, Any]]:
    """Each engine job of the run (`<run_dir>/engine_jobs/`, and any the controller knows): its Slurm id, Slurm's
    state of it, and its engines as the controller sees them."""
    from hpc_rl.launch.engine_job import recorded_engine_jobs
    from hpc_rl.launch.slurm_status import component_states, job_state

    jobs = {str(job["job_id"]): job for job in recorded_engine_jobs(run_dir)}
    for job_id in live:
        jobs.setdefault(job_id, {"job_id": job_id})
    listed = []
    for job_id, job in jobs.items():
        states = component_states(job_id) if job_id and not job_id.startswith("local-") else []
        engines = (live.get(job_id) or {}).get("engines", {})
        listed.append({"job_id": job_id, "slurm_state": job_state(states) if states else "-",
                       "engines": {index: engine.get("state") for index, engine in engines.items()},
                       "rollout_num_gpus": job.get("rollout_num_gpus")})
    return listed


def _when(stamp: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(stamp)))
    except (TypeError, ValueError):
        return "an unknown time"


def format_status(status: dict[str, Any]) -> str:
    lines = [f"run dir: {status.get('run_dir', '?')}   (source: {status['source']})"]
    if status.get("state") == "dead":
        lines.append(f"run: dead since {_when(status.get('dead_since'))} ({status.get('dead_why', '')})")
        if status.get("last_log_line"):
            lines.append(f"last log line: {status['last_log_line']}")
    elif status.get("state"):
        lines.append(f"run: {status['state']}")
    if "rollout_id" in status:
        lines.append(f"rollout {status['rollout_id']}/{status.get('num_rollout', '?')}, weight version "
                     f"{status.get('weight_version')}, partial buffer {status.get('buffer_size')} group(s)")
    if status.get("reward_mean") is not None:
        lines.append(f"last rollout: reward {status['reward_mean']:.3f}, {status.get('last_rollout_seconds') or 0:.2f} s, "
                     f"{status.get('samples_per_second') or 0:.1f} samples/s")
    retained = status.get("retained")
    if retained:  # controller/retention.py: generated, not yet in a checkpoint; a resume trains them first
        lines.append(f"retained rollouts: {len(retained.get('journaled', []))} journaled "
                     f"{retained.get('journaled', [])}, {len(retained.get('to_train', []))} to train first; "
                     f"{retained.get('generations_saved', 0)} generation(s) saved by this attempt")
    components = status.get("components", {})
    for rank, trainer in components.get("trainers", {}).items():
        lines.append(f"trainer rank {rank}: pid {trainer['pid']} on {trainer['host']}")
    for index, engine in components.get("engines", {}).items():
        extra = f", restarts {engine['restarts']}" if engine.get("restarts") else ""
        lines.append(f"engine {index}: {engine['state']} at {engine['url']}{extra}")
    for job in status.get("engine_job_list") or []:
        engines = ", ".join(f"engine {i} {state}" for i, state in job["engines"].items()) or "no engine joined"
        lines.append(f"engine job {job['job_id']}: slurm {job['slurm_state']}; {engines}")
    for warning in status.get("warnings") or []:  # a silent trainer rank, a run that cannot score
        lines.append(f"WARNING: {warning}")
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
