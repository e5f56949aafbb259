"""Stopping a step or an engine that is stopped itself (SIGSTOP: a stuck engine the fleet restarts, a SIGTERM'd run
with an engine stuck in a sync) takes its SIGTERM at once, as with Slurm's scancel (SIGCONT, SIGTERM): it is not
left to be SIGKILLed after the whole grace."""

from __future__ import annotations

import os
import signal
import sys
import time

from hpc_rl.process.child_process import start_process_group, stop_process_group


def test_a_stopped_process_takes_its_sigterm_at_once(tmp_path) -> None:
    popen = start_process_group([sys.executable, "-c", "import time; time.sleep(60)"], env=None,
                                log_path=tmp_path / "sleeper.log")
    try:
        time.sleep(0.2)
        os.kill(popen.pid, signal.SIGSTOP)
        started = time.monotonic()
        code = stop_process_group(popen, grace_seconds=10.0)
        assert time.monotonic() - started < 8.0  # old: the whole grace (10 s), then SIGKILL
        assert code == -signal.SIGTERM
    finally:
        if popen.poll() is None:
            popen.kill()
