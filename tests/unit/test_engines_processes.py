"""Unit tests of child-process handling: log tails in errors, no orphans after stop."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.process.child_process import (PLANNED_PORTS_START, ChildProcess, ChildProcessFailed, ephemeral_port_range, free_port,
                                          http_ok, planned_port, wait_until)
from hpc_rl.engines.engine_process import _HttpEngineProcess
from tests.unit import waiting


def test_dead_engine_error_shows_log_tail(tmp_path):
    command = [sys.executable, "-c", "print('CUDA out of memory, simulated'); raise SystemExit(3)"]
    engine = _HttpEngineProcess(command, host="127.0.0.1", port=free_port(), log_path=tmp_path / "e.log",
                                env=os.environ, name="fake engine")
    engine.start()
    try:
        with pytest.raises(ChildProcessFailed, match="(?s)exited with code 3.*CUDA out of memory, simulated"):
            engine.wait_healthy(timeout=20)
    finally:
        engine.stop()


def test_timeout_error_and_stop_kills_the_whole_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); print('waiting', flush=True); "
              "time.sleep(60)")
    process = ChildProcess([sys.executable, "-c", script], log_path=tmp_path / "c.log", name="sleeper")
    process.start()
    try:
        with pytest.raises(ChildProcessFailed, match="(?s)was not ready after 1 s.*still running"):
            wait_until(lambda: pid_file.exists() and False, process=process, timeout=1, what="ready")
        # the file exists (empty) before the pid is in it: wait for the pid itself
        waiting.wait_until_blocking(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit(),
                                    what="the grandchild's pid")
    finally:
        process.stop(grace_seconds=2)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # signalled by the stop; it ends once scheduled (seconds on a loaded machine)
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(grandchild)
    assert not process.alive()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for the container's init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_http_ok_is_false_on_a_closed_port():
    assert not http_ok(f"http://127.0.0.1:{free_port()}/health", timeout=0.5)


EXIT_CHILD = """
import atexit, multiprocessing, os, sys
from hpc_rl.process.child_process import exit_without_teardown
manager = multiprocessing.Manager()  # a child process, as Megatron's checkpoint writer starts one
print("manager", manager._process.pid)
atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
print("buffered line, never flushed by hand", end="")
exit_without_teardown(3)
"""


def test_exit_without_teardown_runs_exit_handlers_and_leaves_no_child(tmp_path):
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", EXIT_CHILD, str(marker)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 3, done.stderr
    assert marker.read_text() == "atexit ran"
    assert done.stdout.endswith("buffered line, never flushed by hand")
    manager_pid = int(done.stdout.split()[1])
    deadline = time.monotonic() + 30
    while running(manager_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(manager_pid), "the Manager process outlived its parent"


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_planned_ports_stay_out_of_the_ephemeral_range():
    """Outgoing connections take ports from the ephemeral range: a planned server port must not be there."""
    low, _ = ephemeral_port_range()
    ports = {planned_port(rng=random.Random(seed)) for seed in range(20)}
    assert all(PLANNED_PORTS_START <= port < low for port in ports) and len(ports) > 10


def test_planned_ports_of_one_process_differ_until_bound():
    """Two plans drawn before either binds (a local run's engines, a test's two engines) get different ports, even
    from draws that would repeat (the same seed twice)."""
    first, second = planned_port(rng=random.Random(5)), planned_port(rng=random.Random(5))
    assert first != second
