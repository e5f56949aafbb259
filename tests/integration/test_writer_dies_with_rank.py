"""Megatron's checkpoint writer's helpers die with the rank that started them, outside Slurm too (issue 37, case 3):
a driver SIGKILLed on a workstation took the rank with it and left the writer's Manager (`spawn_main`) and the
resource tracker to PID 1, or one of the write workers the writer forks during a save (blocked on a queue the dead
rank held) with the tracker. A real rank-like process arms the writer as a trainer rank does, makes Megatron start
its Manager, forks a write worker the way the writer does (its body a fake that blocks), and is SIGKILLed; every
helper must be gone within seconds (on the code before: all three stayed)."""

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
import multiprocessing, os, sys, time
from hpc_rl.training.term_deferral import defer_sigterm_in_slurm_step
from megatron.core.dist_checkpointing.strategies import filesystem_async
def blocked_write_worker(*args, **kwargs):  # a fake worker's body: one blocked on a queue the dead rank held
    time.sleep(600)
filesystem_async.FileSystemWriterAsync.write_preloaded_data = staticmethod(blocked_write_worker)
defer_sigterm_in_slurm_step()
filesystem_async._get_write_results_queue()
worker = multiprocessing.get_context("fork").Process(target=filesystem_async.FileSystemWriterAsync.write_preloaded_data)
worker.start()  # as Megatron's writer forks one per write bucket in a save
time.sleep(0.5)
print("ready", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_writers_manager_workers_and_resource_tracker_die_with_a_killed_rank_outside_slurm() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    rank = subprocess.Popen([sys.executable, "-c", RANK], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    helpers: list[int] = []
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        helpers = children(rank.pid)
        assert len(helpers) == 3, helpers  # the Manager, the resource tracker and a write worker
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
