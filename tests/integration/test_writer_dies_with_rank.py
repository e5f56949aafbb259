"""Megatron's checkpoint writer's helpers die with the rank that started them, outside Slurm too (issue 37, case 3):
a driver SIGKILLed on a workstation took the rank with it and left the writer's Manager (`spawn_main`) and the
resource tracker to PID 1. A real rank-like process arms the writer as a trainer rank does, makes Megatron start its
Manager, and is SIGKILLed; both helpers must be gone within seconds (on the code before: both stayed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hpc_rl
from hpc_rl.launch.orphans import children

REPO = Path(hpc_rl.__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # ~10 s: Megatron's import and a spawned Manager

RANK = """
import os, sys, time
from hpc_rl.training.term_deferral import defer_sigterm_in_slurm_step
from megatron.core.dist_checkpointing.strategies import filesystem_async
defer_sigterm_in_slurm_step()
filesystem_async._get_write_results_queue()
print("ready", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_writers_manager_and_resource_tracker_die_with_a_killed_rank_outside_slurm() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    rank = subprocess.Popen([sys.executable, "-c", RANK], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    helpers: list[int] = []
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        helpers = children(rank.pid)
        assert len(helpers) == 2, helpers  # the Manager and the resource tracker
        rank.kill()
        rank.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in helpers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in helpers if _alive(pid)]
        assert left == [], f"left behind after the rank's SIGKILL: {left}"
    finally:
        if rank.poll() is None:
            rank.kill()
        for pid in helpers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
