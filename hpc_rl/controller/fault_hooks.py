"""Fault injection for the controller: its process killed at a chosen moment, for tests of what a requeue or a
restart does then (tests/slurm/test_faults_slurm.py, tests/integration/test_checkpoint_safety.py).

Owns the fault points. The variable's value is `<rollout id>:<marker file>`: the first controller to reach the
point for that rollout while the marker does not exist creates it and SIGKILLs its own process (the driver's:
the controller runs in it), so the fault happens once per run and the requeued attempt runs normally. Unset in
real runs (nothing here runs then but one environment lookup per checkpoint).

    variable                                   point                                        then
    HPC_RL_FAULT_KILL_CONTROLLER_AFTER_SAVE    the checkpoint of that rollout has committed,  SIGKILL
                                               before the rollout's record is written
    HPC_RL_FAULT_KILL_CONTROLLER_AFTER_RETAIN  the rollout was generated and journaled         SIGKILL
                                               (controller/retention.py), not trained yet
    HPC_RL_FAULT_HOLD_CONTROLLER_AFTER_RETAIN  the same point                                  the loop waits
                                               (the event loop runs on: the test scancels the   forever
                                               job while the rollout is journaled, untrained)
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping

KILL_CONTROLLER_AFTER_SAVE = "HPC_RL_FAULT_KILL_CONTROLLER_AFTER_SAVE"
KILL_CONTROLLER_AFTER_RETAIN = "HPC_RL_FAULT_KILL_CONTROLLER_AFTER_RETAIN"
HOLD_CONTROLLER_AFTER_RETAIN = "HPC_RL_FAULT_HOLD_CONTROLLER_AFTER_RETAIN"


def kill_here_if_asked(variable: str, rollout_id: int, environ: Mapping[str, str] = os.environ) -> None:
    """SIGKILL this process when `variable` names `rollout_id` and its marker is not there yet (then create it)."""
    value = environ.get(variable)
    if not value:
        return
    if _first_time(value, rollout_id):
        os.kill(os.getpid(), signal.SIGKILL)


async def hold_here_if_asked(variable: str, rollout_id: int, environ: Mapping[str, str] = os.environ) -> None:
    """Wait forever (until cancelled: the job's end) when `variable` names `rollout_id` and its marker is not
    there yet (then create it): the caller's work stops there while the controller still answers (status, pings)."""
    value = environ.get(variable)
    if value and _first_time(value, rollout_id):
        await asyncio.Event().wait()


def _first_time(value: str, rollout_id: int) -> bool:
    """`value` (`<rollout id>:<marker>`) names `rollout_id` and the marker did not exist (it does now)."""
    wanted, _, marker = value.partition(":")
    if not marker or wanted.strip() != str(rollout_id):
        return False
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True
