"""A trainer rank's SIGTERM inside a Slurm step: keep serving the controller for a grace time, then go.

`scancel` and preemption send SIGTERM to every process of every step at once. The driver's controller
then saves the rollout the ranks last trained (`hpc_rl.controller.signal_stop`) and needs them alive for
it: a rank that dies on the spot leaves no checkpoint (issue 24). So in a Slurm step a rank that gets
SIGTERM goes on executing commands until its StopCommand, until the controller goes away, or until
RANK_TERM_GRACE_S have passed; then it exits as SIGTERM would have made it (after the atexit handlers:
Megatron's checkpoint writer stops its helper processes). A second SIGTERM ends it at once.

Outside Slurm a rank's only SIGTERM comes from the driver stopping the trainer step (the user's signals
reach the driver alone: steps run in their own sessions), so it keeps Python's default there.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType

log = logging.getLogger(__name__)

RANK_TERM_GRACE_S = 25.0
"""Below Slurm's default KillWait (30 s), after which Slurm kills the step anyway."""
EXIT_TERMINATED = 128 + signal.SIGTERM


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_STEP_ID")) and bool(environ.get("SLURM_JOB_ID"))


def defer_sigterm(grace_s: float = RANK_TERM_GRACE_S, exit_fn: Callable[[int], object] | None = None) -> None:
    """Install the handler (call from the main thread, after the controller link is up)."""
    if exit_fn is None:
        from hpc_rl.engines.child_process import exit_without_teardown

        exit_fn = exit_without_teardown
    chosen_exit = exit_fn

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        log.warning("SIGTERM: serving the controller's last commands for at most %.0f s (a checkpoint may be "
                    "saved), then exiting; a second SIGTERM exits now", grace_s)
        signal.signal(signal.SIGTERM, lambda *_: chosen_exit(EXIT_TERMINATED))
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
