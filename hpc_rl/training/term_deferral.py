"""A trainer rank's SIGTERM inside a Slurm step: keep serving the controller for a grace time, then go.

`scancel` and preemption send SIGTERM to every process of every step at once. The driver's controller
then saves the rollout the ranks last trained (`hpc_rl.controller.signal_stop`) and needs them alive for
it: a rank that dies on the spot leaves no checkpoint (issue 24). So in a Slurm step a rank that gets
SIGTERM goes on executing commands until its StopCommand, until the controller goes away, or until
RANK_TERM_GRACE_S have passed; then it exits as SIGTERM would have made it (after the atexit handlers:
Megatron's checkpoint writer stops its helper processes). The SIGTERMs that follow within SAME_STOP_S are
the same stop passed on (torchrun's agent sends each rank one as soon as it gets its own); a SIGTERM after
that ends the rank at once.

Outside Slurm a rank's only SIGTERM comes from the driver stopping the trainer step (the user's signals
reach the driver alone: steps run in their own sessions), so it keeps Python's default there.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType

log = logging.getLogger(__name__)

RANK_TERM_GRACE_S = 25.0
"""Below Slurm's default KillWait (30 s), after which Slurm kills the step anyway."""
SAME_STOP_S = 5.0
"""SIGTERMs this soon after the first are the same stop, passed on: slurmd signals every process of the step, and
torchrun's agent, signalled too, sends every rank its own SIGTERM at once (measured on the local cluster: 13 ms
after slurmd's), as srun does with its own. Before, the rank took the agent's as "a second SIGTERM" and exited at
once: after a scancel no rank lived to save a checkpoint, whatever Slurm's KillWait."""
EXIT_TERMINATED = 128 + signal.SIGTERM


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_STEP_ID")) and bool(environ.get("SLURM_JOB_ID"))


def defer_sigterm(grace_s: float = RANK_TERM_GRACE_S, exit_fn: Callable[[int], object] | None = None, *,
                  same_stop_s: float = SAME_STOP_S) -> None:
    """Install the handler (call from the main thread, after the controller link is up)."""
    if exit_fn is None:
        from hpc_rl.engines.child_process import exit_without_teardown

        exit_fn = exit_without_teardown
    chosen_exit = exit_fn

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        first = time.monotonic()
        log.warning("SIGTERM: serving the controller's last commands for at most %.0f s (a checkpoint may be "
                    "saved), then exiting; a SIGTERM more than %.0f s later exits now", grace_s, same_stop_s)

        def again(signum: int, frame: FrameType | None) -> None:
            if time.monotonic() - first < same_stop_s:
                return  # the same stop, passed on by torchrun's agent or srun (SAME_STOP_S)
            chosen_exit(EXIT_TERMINATED)

        signal.signal(signal.SIGTERM, again)
        timer = threading.Timer(grace_s, chosen_exit, args=(EXIT_TERMINATED,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)


def defer_sigterm_in_slurm_step() -> bool:
    """`defer_sigterm()` when this rank runs in a Slurm step; whether it did."""
    if not in_slurm_step(os.environ):
        return False
    defer_sigterm()
    return True
