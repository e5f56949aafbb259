"""Trainer liveness on a whole local run (issue 37 case 4): a trainer rank SIGSTOPped mid-run is named in the log
and in `python -m hpc_rl.status` while it is silent, and the run fails naming it after
`controller.trainer_command_timeout`, leaving no process behind (old: no word, status "running", the run waited
as long as the stop lasted). Bounds kept small (timeout 20 s: named after 10 s) so the case takes seconds; `-s`
prints the times docs/faults.md quotes. The status is asked between the naming and the failure, a window of
timeout/2: at 12 s (6 s) a loaded 2-core machine's status calls (a Python start and a controller query each) could
miss it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.run_helpers import (REPO_ROOT, processes_of_run, records, start_run, trainer_rank_pids,
                                           wait_for)

pytestmark = pytest.mark.slow


def status_text(run_dir: Path) -> str:
    return subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60).stdout


def test_a_stopped_trainer_rank_is_named_then_fails_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "stopped"
    process = start_run(run_dir, "--num-rollout", "400", "--set", "eval.eval_interval=null",
                        "--set", "controller.trainer_command_timeout=20")
    rank0 = 0
    try:
        wait_for(lambda: len(records(run_dir)) >= 2, 300, "two rollouts")
        rank0 = trainer_rank_pids(run_dir)[0]
        os.kill(rank0, signal.SIGSTOP)
        stopped = time.monotonic()
        named_in_status = None
        while process.poll() is None and time.monotonic() - stopped < 120:
            text = status_text(run_dir)
            if named_in_status is None and "WARNING: trainer rank 0 has not answered for" in text:
                named_in_status = time.monotonic() - stopped
                assert "stopped or hung?" in text
            time.sleep(0.5)
        code = process.wait(120)
        failed = time.monotonic() - stopped
    finally:
        if rank0:
            try:
                os.kill(rank0, signal.SIGKILL)  # (a stopped process ends only by SIGKILL or after SIGCONT)
            except ProcessLookupError:
                pass
        if process.poll() is None:
            process.kill()
    output = (tmp_path / "stopped.out").read_text()
    log = (run_dir / "logs" / "controller.log").read_text()
    print(f"\nSIGSTOP -> named in status {named_in_status} s, run ended {failed:.1f} s (exit {code})")
    assert code == 1, output[-3000:]
    assert named_in_status is not None, "status never named the silent rank"
    assert "trainer rank 0 has not answered for" in log and "stopped or hung?" in log
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed"
    assert "trainer rank 0 has not answered for" in status["last_error"], status["last_error"]
    assert "controller.trainer_command_timeout" in status["last_error"]
    assert "trainer rank 0 has not answered" in output  # the user's terminal says it too
    deadline = time.monotonic() + 30
    while (left := processes_of_run(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {left}"
