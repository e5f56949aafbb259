"""The driver SIGKILLed at a chosen point of a checkpointing tiny run, and what of the run is left (issue 37, case 3).

A local run's driver is the submit process; everything else (controller tasks aside: they are the driver) is its
descendant: the CPU engine, the router, torchrun's agent, the ranks and Megatron's checkpoint writer's Manager and
resource tracker (found by `HPC_RL_RUN_DIR` in their environment: `run_helpers.processes_of_run`). Kill points:
"save": while a checkpoint is being written (an `iter_XXXXXXX.tmp` dir exists: the writer's helpers are alive then;
the kill follows the sight of it by a poll, so a loaded machine may have committed it meanwhile: the outcome's
`point` says so);
"random": a random time after every component registered. Used by
tests/integration/test_checkpoint_safety.py (a few kills) and benchmarks/bench_driver_kills.py (20).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.run_helpers import processes_of_run, start_run, wait_for

LEFT_AFTER_S = 20.0
"""What is still alive this long after the kill was left behind (the issue saw a pair for 40+ s)."""
WATCHED_S = 60.0
"""How long what was left is watched before it is ended (whether it goes by itself, late)."""


@dataclass
class KillOutcome:
    point: str
    """Where the driver died ("during the save of iter_0000003", "12.3 s after registration")."""
    gone_s: float | None
    """Seconds from the kill until no process of the run was left (None: some were left)."""
    left: list[str] = field(default_factory=list)
    """What was alive LEFT_AFTER_S after the kill: pid, parent, state, kernel wait channel, command line."""
    left_gone_s: float | None = None
    """Seconds from the kill until what was left went by itself (None: still there after WATCHED_S; ended then)."""


def _saving(checkpoints: Path) -> str | None:
    try:
        return next((p.name.removesuffix(".tmp") for p in checkpoints.iterdir() if p.name.endswith(".tmp")
                     and p.name.startswith("iter_")), None)
    except OSError:
        return None


def _described(line: str) -> str:
    pid = line.split(":", 1)[0]
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
    except OSError:
        return line
    return f"{pid} (parent {fields[1]}, state {fields[0]}, wchan {wchan}):{line.split(':', 1)[1][:90]}"


def _end(lines: list[str]) -> None:
    """SIGKILL what a kill left behind (the test's own run's processes, by pid), so the next trial starts clean."""
    for line in lines:
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def kill_driver(run_dir: Path, *, point: str, rng: random.Random, timeout_s: float = 400) -> KillOutcome:
    """Start a tiny run that saves after every rollout, SIGKILL its driver at `point` ("save" or "random"), and
    report what of it was left after LEFT_AFTER_S."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    driver = start_run(run_dir, "--num-rollout", "300", "--save-interval", "1", "--set", "eval.eval_interval=null")
    checkpoints = run_dir / "checkpoints"
    try:
        log = run_dir / "logs" / "controller.log"
        wait_for(lambda: driver.poll() is not None or (log.is_file() and "all components registered" in
                                                        log.read_text()), timeout_s, "every component registered")
        assert driver.poll() is None, f"the run ended before the kill (exit {driver.returncode})"
        if point == "save":
            nth = rng.randrange(1, 4)  # the first, second or third save
            seen: list[str] = []
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and driver.poll() is None:
                saving = _saving(checkpoints)
                if saving is not None and saving not in seen:
                    seen.append(saving)
                    if len(seen) == nth:
                        break
                time.sleep(0.005)
            assert len(seen) == nth, f"no save #{nth} seen ({seen})"
            where = f"during the save of {seen[-1]}"
        else:
            delay = rng.uniform(0.0, 25.0)
            time.sleep(delay)
            where = f"{delay:.1f} s after registration"
        os.kill(driver.pid, signal.SIGKILL)
        if point == "save" and not (checkpoints / f"{seen[-1]}.tmp").exists():  # seen under way, committed since:
            where = f"just after the save of {seen[-1]} committed"  # (a loaded machine's poll-to-kill gap) say so
    except BaseException:
        os.kill(driver.pid, signal.SIGKILL)
        raise
    finally:
        killed = time.monotonic()
        driver.wait(30)
    gone: float | None = None
    while time.monotonic() - killed < LEFT_AFTER_S:
        if not processes_of_run(run_dir):
            gone = time.monotonic() - killed
            break
        time.sleep(0.1)
    left = processes_of_run(run_dir)
    described = [_described(line) for line in left]
    left_gone: float | None = None
    while left and time.monotonic() - killed < WATCHED_S:
        if not processes_of_run(run_dir):
            left_gone = time.monotonic() - killed
            break
        time.sleep(0.2)
    _end(processes_of_run(run_dir))
    return KillOutcome(point=where, gone_s=gone, left=described, left_gone_s=left_gone)
