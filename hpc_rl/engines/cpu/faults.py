"""Fault injection for the CPU engine: an engine process that fails at a chosen moment, for tests of what the
controller does then (tests/integration/test_engine_faults_in_sync.py, test_weight_sync_faults.py).

Owns the fault points and what happens at each. Every variable names a marker file: the first CPU engine of
the run to reach the point while that file does not exist creates it and fails there, so one engine fails
once per run and its restarted process runs normally. Every variable is unset in real runs (nothing here
runs then but one environment lookup per point).

    variable                              point                                   the engine
    HPC_RL_FAULT_EXIT_IN_WEIGHT_SYNC      a broadcast bucket is asked for         exits before receiving
    HPC_RL_FAULT_STOP_IN_WEIGHT_SYNC      a broadcast bucket is asked for         stops itself (SIGSTOP): a hung
                                                                                  GPU, a process frozen by the OS
    HPC_RL_FAULT_EXIT_IN_GROUP_INIT       /init_weights_update_group is asked     exits before joining the group
    HPC_RL_FAULT_EXIT_IN_GENERATE         a /generate request is asked            exits (an eval or rollout cut)

One variable is a gate, not a failure, for tests that need requests certainly in flight at a moment they choose
(an engine leaving mid-rollout, a run that must wait for a joiner: tests/integration/test_engine_jobs.py; a pause,
an abort or a weight update that must find a request running: test_engine_conformance.py, test_engines_cluster.py):
it names a file the test creates and removes.

    HPC_RL_FAULT_HOLD_GENERATION          every scheduler step, while that        decodes nothing: its requests
                                          file exists                             stay in flight until aborted
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping

EXIT_IN_WEIGHT_SYNC = "HPC_RL_FAULT_EXIT_IN_WEIGHT_SYNC"
STOP_IN_WEIGHT_SYNC = "HPC_RL_FAULT_STOP_IN_WEIGHT_SYNC"
EXIT_IN_GROUP_INIT = "HPC_RL_FAULT_EXIT_IN_GROUP_INIT"
EXIT_IN_GENERATE = "HPC_RL_FAULT_EXIT_IN_GENERATE"
HOLD_GENERATION = "HPC_RL_FAULT_HOLD_GENERATION"

HOLD_POLL_S = 0.05
"""How often a held scheduler looks at the gate file again when nothing else wakes it."""


def _first_to_claim(marker: str) -> bool:
    """Create `marker`; False when it exists already (another engine, or this one's earlier process, failed)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


def fail_here_if_asked(*variables: str, environ: Mapping[str, str] = os.environ) -> None:
    """At a fault point: fail as the first set variable of `variables` asks (exit, or SIGSTOP this process),
    once per marker file; return otherwise."""
    for variable in variables:
        marker = environ.get(variable)
        if not marker or not _first_to_claim(marker):
            continue
        if variable == STOP_IN_WEIGHT_SYNC:
            os.kill(os.getpid(), signal.SIGSTOP)  # resumes only when someone sends SIGCONT (or it is killed)
            return
        os._exit(1)


def generation_hold(environ: Mapping[str, str] = os.environ) -> Callable[[], bool] | None:
    """The gate of `HOLD_GENERATION`: a check that is True while its file exists; None when the variable is unset
    (every real run: the scheduler then never looks)."""
    marker = environ.get(HOLD_GENERATION)
    if not marker:
        return None
    return lambda: os.path.exists(marker)
