"""The driver: the job's first process. Runs the controller and the router, and starts every other step.

    run dir (written at submit: config.resolved.yaml, topology.json, secret) ──> run_plan.load_run_plan
      ──> run_driver: the run dir's lock ──> attempts: Driver (supervisor) of one attempt ──> exit code

Owns: the run's entry (`python -m hpc_rl.launch.driver --run-dir DIR [--launcher srun]`, and `run_driver`, which
submitit's batch step calls), the run dir's lock for the whole job, the run's log files (`setup_logging`), the
attempts (a run that fails because a trainer rank died starts again from the last checkpoint, up to
`controller.max_restarts` times; in a job Slurm requeued, the restarts status.json listed so far), the resume
check before each attempt, and how an attempt ends: its exit code and the signals it listens to (`signals`).
An attempt itself (start order, supervision, restarts of engines, shutdown) is `supervisor.Driver`; its parts
are `servers`, `ports`, `node_watch` and `signals`. The same code runs locally (`LocalStepLauncher`) and
inside a Slurm allocation (`SrunStepLauncher`); only the launcher differs.

The job's engine key (derived from the secret: `engine_api_key`) guards every engine endpoint but
/health and the router's own endpoints; the controller presents it on each call. It never goes on a
command line (`ps` shows those) nor into hpc_rl's logs: engines and the router get it in their
environment (`API_KEY_ENV`), SGLang (which reads no variable for it) in a 0600 `--config` file of the
run dir; SGLang logs it itself at start, so SGLang engine logs are created 0600 (`servers`).

A node that dies under the job (Slurm only) is named with the steps it ran, and the job requeued while
`controller.max_restarts` allows (`node_watch`).

Exit codes: 0 done, 1 failed, 2 the run dir cannot be used (its topology.json, or no whole checkpoint to
resume), 3 stopped for checkpoint-and-requeue (USR2), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from hpc_rl.controller.trainer_channel import TrainerFailed
from hpc_rl.launch.orphans import become_subreaper
from hpc_rl.launch.run_lock import RunDirLocked, acquire
from hpc_rl.launch.run_plan import RunPlan, TopologyFileError, load_run_plan
from hpc_rl.launch.signals import StoppedBySignal
from hpc_rl.launch.steps import LocalStepLauncher, StepLauncher
from hpc_rl.launch.submit_args import EXIT_INVALID
from hpc_rl.launch.supervisor import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_REQUEUE, Driver
from hpc_rl.telemetry.run_files import RunLogFileHandler

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REQUEUE", "Driver", "main", "run_driver"]

log = logging.getLogger("hpc_rl.driver")


def setup_logging(run_dir: Path, level: str) -> None:
    """hpc_rl's records to `logs/controller.log` (warnings also to stderr), through the `hpc_rl` logger:
    the root logger and its handlers stay the application's (a library user keeps theirs). Idempotent."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    file_handler = RunLogFileHandler(run_dir / "logs" / "controller.log")  # a full disk: one line, not one per record
    file_handler.setFormatter(formatter)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(formatter)
    console.setLevel(logging.WARNING)
    package = logging.getLogger("hpc_rl")
    for handler in [h for h in package.handlers if getattr(h, "hpc_rl_run_log", False)]:
        package.removeHandler(handler)
        handler.close()
    for handler in (file_handler, console):
        handler.hpc_rl_run_log = True  # type: ignore[attr-defined]
        package.addHandler(handler)
    package.setLevel(level)


def run_driver(run_dir: str | Path, launcher: StepLauncher, *, local: bool, plan: RunPlan | None = None) -> int:
    """Run the whole job; returns an exit code (see the module docstring). `plan`: the run dir's, when the
    caller read it already (else it is read here, once for every attempt).

    A run that fails because a trainer rank died starts again from the last checkpoint, up to
    `controller.max_restarts` times (every process of the failed attempt is stopped first); each
    restart is printed, logged and listed in status.json under "restarts"."""
    job_id = None if local else os.environ.get("SLURM_JOB_ID") or None
    try:  # one run per run dir (a requeued attempt of this job, or this process's submit, hands it over)
        lock = acquire(Path(run_dir).resolve(), role="driver", job_id=job_id)
    except RunDirLocked as busy:
        print(f"hpc_rl: {busy}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    lock.start_heartbeat()
    if local:
        become_subreaper()  # orphans of the run's processes come here, and are ended at shutdown
    code = EXIT_FAILED
    try:
        code = _run_attempts(Path(run_dir).resolve(), launcher, local=local, plan=plan)
    finally:
        if not local:  # the job may run again (a requeue); Slurm's state of it says when it ended for good
            lock.keep()
        lock.release()
    return code


def _run_attempts(run_dir: Path, launcher: StepLauncher, *, local: bool, plan: RunPlan | None) -> int:
    restarts = requeued_attempts(run_dir)
    try:
        plan = plan if plan is not None else load_run_plan(run_dir)
    except TopologyFileError as error:
        print(f"hpc_rl: {error}", file=sys.stderr, flush=True)
        return EXIT_INVALID
    # before the first Driver: its constructor already logs (ports found in use on the node)
    setup_logging(run_dir, plan.config.logging.log_level)
    for note in plan.notes:
        log.warning("%s", note)
    while True:
        if (refused := _resume_refused(run_dir, plan)) is not None:
            return refused
        driver = Driver(run_dir, launcher, local=local, plan=plan)
        driver.restarts = restarts
        code = asyncio.run(_drive(driver))
        limit = driver.config.controller.max_restarts
        if code != EXIT_FAILED or not isinstance(driver.failure, TrainerFailed):
            return code
        if len(restarts) >= limit:
            if limit:
                print(f"hpc_rl: no restart left (controller.max_restarts={limit} used)", file=sys.stderr, flush=True)
            return code
        restarts.append({"at": time.time(), "reason": str(driver.failure).split("\n")[0]})
        message = (f"restarting from the last checkpoint (restart {len(restarts)} of {limit}) after: "
                   f"{restarts[-1]['reason']}")
        log.warning(message)
        print(f"hpc_rl: {message}", file=sys.stderr, flush=True)


def _resume_refused(run_dir: Path, plan: RunPlan | None = None) -> int | None:
    """Before any process of an attempt starts: which checkpoint it resumes from (one line when some were
    skipped), or EXIT_INVALID when the checkpoint dir holds checkpoints and none is whole (run_attempts)."""
    from hpc_rl.config import load_resolved_config
    from hpc_rl.launch.run_attempts import check_resume

    config = plan.config if plan is not None else load_resolved_config(run_dir)
    skipped, refusal = check_resume(config, "the same command with")
    if refusal is not None:
        log.error("%s", refusal)
        return EXIT_INVALID
    if skipped is not None:
        log.warning("%s", skipped)
    return None


def requeued_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """In a job Slurm requeued (SLURM_RESTART_COUNT > 0: a node failed, the time limit came, the driver
    died): the restarts the last status.json listed, plus one for the attempt that ended before this one,
    with what it said (so status.json keeps saying what happened). [] in a first attempt."""
    try:
        requeues = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        requeues = 0
    if requeues <= 0:
        return []
    try:
        status = json.loads((run_dir / "status.json").read_text())
        earlier = [r for r in status.get("restarts") or [] if isinstance(r, dict)]
        last_error, state, at = str(status.get("last_error") or ""), status.get("state"), status.get("updated_at")
    except (OSError, ValueError, AttributeError):
        earlier, last_error, state, at = [], "", None, None
    if last_error:
        why = last_error.splitlines()[0]
    elif state == "stopped":
        why = "the attempt saved and stopped (time limit, preemption or a signal)"
    else:
        why = f"the attempt ended without a word (state {state or 'unknown'}: its driver or node died?)"
    return earlier + [{"at": at or time.time(), "reason": f"job requeued by Slurm (requeue {requeues}) after: {why}"}]


async def _drive(driver: Driver) -> int:
    """One attempt under the signal handlers; its exit code."""
    task = asyncio.current_task()
    assert task is not None
    driver.signals.install(task)
    try:
        return await driver.run()
    except StoppedBySignal:
        log.info("stopped by SIGTERM")
        return EXIT_INTERRUPTED
    except asyncio.CancelledError:
        log.info("interrupted by a signal; stopping every process of the run")
        print("hpc_rl: interrupted; stopping every process of the run", file=sys.stderr, flush=True)
        if await driver.nodes.check():  # Slurm ends a job whose node went DOWN: say which one and why
            log.error("the job is being ended by Slurm because node(s) %s failed", ", ".join(driver.nodes.lost))
        return EXIT_INTERRUPTED
    except Exception as error:
        if not driver.local and await driver.signals.came_meanwhile(error):
            return EXIT_INTERRUPTED
        driver.failure = error
        log.exception("run failed")
        print(f"hpc_rl: the run failed: {error}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        driver.signals.remove()
        await driver.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one hpc_rl job from its run directory (the batch step).")
    parser.add_argument("--run-dir", required=True, help="run directory with config.resolved.yaml and secret")
    parser.add_argument("--launcher", choices=("local", "srun"), default="local")
    args = parser.parse_args(argv)
    if args.launcher == "srun":
        from hpc_rl.launch.sbatch_render import engine_cpus_per_task
        from hpc_rl.launch.srun_launcher import SrunStepLauncher

        try:
            plan = load_run_plan(args.run_dir)
        except TopologyFileError as error:
            print(f"hpc_rl: {error}", file=sys.stderr, flush=True)
            return EXIT_INVALID
        cpus = engine_cpus_per_task(plan.config, plan.topology)  # engines' srun steps get their component's CPUs
        return run_driver(args.run_dir, SrunStepLauncher(cpus_per_task=cpus), local=False, plan=plan)
    return run_driver(args.run_dir, LocalStepLauncher(), local=True)


if __name__ == "__main__":
    raise SystemExit(main())
