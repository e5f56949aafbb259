"""The batch step's first process on Slurm: the driver runs as its child, so a dead driver is noticed.

Owns: `python -m hpc_rl.launch.batch_guard RUN_DIR -- COMMAND...`. submitit's batch script runs
`exec <python> -m hpc_rl.launch.batch_guard RUN_DIR -- <python> -u -m submitit.core._submit <folder>`
(see `slurm_submit.make_executor`). The guard starts COMMAND (the driver: controller in process, every
other process a job step), forwards each signal Slurm sends the batch step (USR2: time limit or
preemption ahead; TERM, INT, CONT, USR1) and exits with COMMAND's code.

When COMMAND was killed by a signal the guard did not forward (SIGKILL, the OOM killer, a crash), the
controller died with it and the steps it started have lost their driver. The guard says so (stderr
and `<run_dir>/logs/controller.log`), then, while `controller.max_restarts` allows (attempts counted
in `<run_dir>/driver_restarts`), requeues the job with `scontrol requeue`: Slurm ends every step of
the allocation and runs the job again, which resumes from the last checkpoint. Otherwise it exits 1:
Slurm ends the job, and with it every step (no step outlives its job).
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FORWARDED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGCONT, signal.SIGUSR1)
RESTARTS_FILE = "driver_restarts"


def note(run_dir: Path, message: str) -> None:
    """To the job's stderr and the run's controller.log (what status and a reader of the logs see)."""
    print(f"hpc_rl: {message}", file=sys.stderr, flush=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:23]
    try:
        with open(run_dir / "logs" / "controller.log", "a") as handle:
            handle.write(f"{stamp} ERROR hpc_rl.batch_guard: {message}\n")
    except OSError:
        pass


def max_restarts(run_dir: Path) -> int:
    from hpc_rl.config.loading import load_resolved_config

    try:
        return int(load_resolved_config(run_dir).controller.max_restarts)
    except Exception as error:  # a config that does not load: no restart, and say why
        print(f"hpc_rl: cannot read controller.max_restarts from {run_dir}: {error}", file=sys.stderr, flush=True)
        return 0


def restarts_used(run_dir: Path) -> int:
    try:
        return int((run_dir / RESTARTS_FILE).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def run(run_dir: Path, command: list[str]) -> int:
    child = subprocess.Popen(command)
    forwarded: set[int] = set()

    def forward(signum: int, _frame: object) -> None:
        forwarded.add(signum)
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:
            continue
    if code >= 0 or -code in forwarded:
        return code if code >= 0 else 128 - code
    died = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    used, limit = restarts_used(run_dir), max_restarts(run_dir)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if used < limit and job_id:
        (run_dir / RESTARTS_FILE).write_text(f"{used + 1}\n")
        note(run_dir, f"the driver (controller) was killed by {died}; requeuing job {job_id} to resume from the "
                      f"last checkpoint (restart {used + 1} of controller.max_restarts={limit})")
        requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        if requeue.returncode == 0:
            time.sleep(60)  # Slurm ends this step now; should it not, fall through and fail
        note(run_dir, f"scontrol requeue {job_id} failed: {requeue.stderr.strip() or requeue.returncode}")
    else:
        note(run_dir, f"the driver (controller) was killed by {died}; the job ends and Slurm stops its steps "
                      f"(no restart left: controller.max_restarts={limit}, used {used})")
    return 1


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m hpc_rl.launch.batch_guard RUN_DIR -- COMMAND...", file=sys.stderr)
        return 2
    return run(Path(args[0]), args[2:])


if __name__ == "__main__":
    raise SystemExit(main())
