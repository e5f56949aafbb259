"""What the driver does on a signal: SIGINT stops at once, SIGTERM saves within the grace then stops, SIGUSR2
saves at the next rollout boundary and stops for a requeue.

SIGTERM (scancel, preemption, `kill`) first saves the rollout the trainer last trained if that fits in the
grace time (`term_grace_s`: Slurm's KillWait minus a margin; 10 s on this machine) and sends the ranks their
stop command (`Controller.stop_with_checkpoint`); one that comes before the controller runs stops at once, as
SIGINT (Ctrl-C) does: the controller is told a stop is under way (a component that now goes away is not a
failure) and the driver's main task is cancelled (its `shutdown` follows). USR2 (time limit or preemption
ahead) is handed to the controller, or kept until it exists. Owns those handlers, the grace time, and
whether a SIGTERM came just as the run ended with an error (then it was a stop, not a failure).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from typing import Any

from hpc_rl.controller.app import Controller

log = logging.getLogger("hpc_rl.driver")

TERM_GRACE_LOCAL_S = 10.0
"""What SIGTERM grants a run on this machine before it must be gone (a `kill`, `docker stop` and systemd
give 10 s before SIGKILL)."""
TERM_GRACE_MARGIN_S = 3.0
"""Of Slurm's KillWait, what is kept for stopping the processes after the save."""
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


class StoppedBySignal(Exception):
    """SIGTERM ended the run (after saving what it could): exit code EXIT_INTERRUPTED, no traceback."""


def term_grace_s(*, local: bool) -> float:
    """Seconds from SIGTERM to the end of the save: locally TERM_GRACE_LOCAL_S; in a Slurm job, Slurm's
    KillWait (SIGTERM to SIGKILL on scancel and preemption; default 30 s) minus TERM_GRACE_MARGIN_S."""
    if local:
        return TERM_GRACE_LOCAL_S
    try:
        shown = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        shown = ""
    return max(0.0, slurm_kill_wait_s(shown) - TERM_GRACE_MARGIN_S)


def slurm_kill_wait_s(scontrol_config: str, default: float = 30.0) -> float:
    """KillWait from `scontrol show config` ("KillWait = 30 sec"); Slurm's default when absent."""
    for line in scontrol_config.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait":
            words = value.split()
            if words and words[0].isdigit():
                return float(words[0])
    return default


class SignalStops:
    """The driver's signal handlers for one attempt (see the module docstring)."""

    def __init__(self, *, local: bool) -> None:
        self.local = local
        self.controller: Controller | None = None
        self.controller_run: asyncio.Task[dict[str, object]] | None = None
        """The controller's run, from its start on (also after the supervisor took over its outcome)."""
        self.graceful: asyncio.Task[None] | None = None
        """After SIGTERM: the task that saves what the grace time allows and ends the controller's run."""
        self.requeue_requested = False

    def attach(self, controller: Controller) -> None:
        """The controller exists (listening): a USR2 that came before goes to it."""
        self.controller = controller
        if self.requeue_requested:
            controller.request_checkpoint_and_stop()

    def install(self, main: asyncio.Task[Any]) -> None:
        """SIGINT, SIGTERM and SIGUSR2 handlers on the running loop; `main` is the task a stop cancels."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self.interrupt, main)
        loop.add_signal_handler(signal.SIGTERM, self.terminate, main)
        loop.add_signal_handler(signal.SIGUSR2, self.request_checkpoint)

    @staticmethod
    def remove() -> None:
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)

    def note_stopping(self) -> None:
        if self.controller is not None:
            self.controller.note_stopping()

    def interrupt(self, main: asyncio.Task[Any]) -> None:
        """SIGINT: stop at once."""
        self.note_stopping()
        main.cancel()

    def request_checkpoint(self) -> None:
        """USR2 (time limit or preemption ahead): save at the next rollout boundary, then stop for requeue.
        A USR2 that arrives before the controller exists (Slurm may signal early) is kept for it."""
        log.warning("checkpoint-and-requeue requested")
        self.requeue_requested = True
        if self.controller is not None:
            self.controller.request_checkpoint_and_stop()

    def terminate(self, main: asyncio.Task[Any]) -> None:
        """SIGTERM: save what the grace time allows, then stop (one before the controller runs stops at
        once). Another SIGTERM changes nothing: Slurm delivers scancel's to the batch step twice (to the
        guard's process group and through the guard); SIGINT stops at once."""
        if self.graceful is not None:
            log.info("SIGTERM again: already stopping (SIGINT stops at once)")
            return
        if self.controller_run is None or self.controller is None:
            self.interrupt(main)
            return
        self.graceful = asyncio.create_task(self._stop_gracefully(self.controller, self.controller_run),
                                            name="graceful stop")

    async def _stop_gracefully(self, controller: Controller, run: asyncio.Task[Any]) -> None:
        grace = term_grace_s(local=self.local)
        message = f"SIGTERM: stopping; a checkpoint is saved if one can be within {grace:.0f} s"
        log.warning(message)
        print(f"hpc_rl: {message}", file=sys.stderr, flush=True)
        began = time.perf_counter()
        outcome = await controller.stop_with_checkpoint(run, grace)
        log.warning("%s (%.1f s after SIGTERM)", outcome, time.perf_counter() - began)
        print(f"hpc_rl: {outcome} ({time.perf_counter() - began:.1f} s after SIGTERM)", file=sys.stderr, flush=True)

    async def came_meanwhile(self, error: Exception, wait_s: float = 1.0) -> bool:
        """Whether a SIGTERM comes within `wait_s` of the run ending with `error` (then its graceful stop
        has run). On Slurm, scancel and preemption signal every step at once: an engine or the trainer can
        die a moment before the driver's own SIGTERM arrives, and the run must then stop (saving what it
        can), not fail with a traceback."""
        deadline = time.monotonic() + wait_s
        while self.graceful is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.graceful is None:
            return False
        log.warning("SIGTERM came as the run ended with %s: %s (Slurm signals every step at once): a stop, not a "
                    "failure", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        await self.graceful
        return True
