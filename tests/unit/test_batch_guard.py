"""The batch guard: exit codes pass through, forwarded signals are the driver's, a driver killed otherwise is said."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT


def guard(run_dir: Path, code: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    env["PYTHONPATH"] = f"{REPO_ROOT}:{env.get('PYTHONPATH', '')}"
    return subprocess.Popen([sys.executable, "-m", "hpc_rl.launch.batch_guard", str(run_dir), "--", sys.executable,
                             "-c", code], env=env, stderr=subprocess.PIPE, text=True)


def test_exit_code_passes_through(tmp_path: Path) -> None:
    process = guard(tmp_path, "raise SystemExit(3)")
    assert process.wait(60) == 3


def test_a_driver_killed_by_sigkill_is_reported_and_fails_the_job(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    process = guard(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "the driver (controller) was killed by SIGKILL" in stderr
    assert "killed by SIGKILL" in (tmp_path / "logs" / "controller.log").read_text()


def test_usr2_is_forwarded_to_the_driver(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    process = guard(tmp_path, "import signal, sys, time, pathlib\n"
                              "signal.signal(signal.SIGUSR2, lambda *a: sys.exit(7))\n"
                              f"pathlib.Path({str(ready)!r}).touch()\n"
                              "time.sleep(60)")
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGUSR2)
    assert process.wait(60) == 7
