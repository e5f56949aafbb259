"""A trainer rank's SIGTERM inside a Slurm step: keep serving the controller for a grace time, then go.

`scancel` and preemption send SIGTERM to every process of every step at once. The driver's controller
then saves the rollout the ranks last trained (`hpc_rl.controller.signal_stop`) and needs them alive for
it: a rank that dies on the spot leaves no checkpoint (issue 24). So in a Slurm step a rank that gets
SIGTERM goes on executing commands until its StopCommand, until the controller goes away, or until
RANK_TERM_GRACE_S have passed; then it exits as SIGTERM would have made it (after the atexit handlers:
Megatron's checkpoint writer stops its helper processes). The SIGTERMs that follow within SAME_STOP_S are
the same stop passed on (torchrun's agent sends each rank one as soon as it gets its own); a SIGTERM after
that ends the rank at once. Megatron's checkpoint writer keeps a helper process (a Manager) that
Slurm's SIGTERM reaches too: it is started with SIGTERM ignored (`keep_checkpoint_writer_through_sigterm`).

Outside Slurm a rank's only SIGTERM comes from the driver stopping the trainer step (the user's signals
reach the driver alone: steps run in their own sessions), so it keeps Python's default there. The writer's
Manager is started the same way everywhere, with the parent-death signal armed: a driver SIGKILLed on this
machine took the rank with it and left the Manager and its resource tracker to PID 1 (5 of 14 trials, issue 37).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.managers import SyncManager
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
        from hpc_rl.process.child_process import exit_without_teardown

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
    """`keep_checkpoint_writer_through_sigterm()` everywhere (its Manager dies with the rank, locally too: issue
    37), and `defer_sigterm()` when this rank runs in a Slurm step; whether it deferred."""
    keep_checkpoint_writer_through_sigterm()
    if not in_slurm_step(os.environ):
        return False
    defer_sigterm()
    return True


_writer_manager: SyncManager | None = None


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (`PR_SET_PDEATHSIG`); exit now when it is already gone."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the subreaper and Slurm's SIGKILL still end it
        return
    if os.getppid() != parent:  # the rank died before the signal was armed
        os._exit(0)


def _ignore_sigterm() -> None:
    """The writer's Manager: SIGTERM ignored (see below), and SIGKILLed when the rank that started it dies
    (`PR_SET_PDEATHSIG`): with SIGTERM ignored, a rank killed outright would otherwise leave it (and the
    resource tracker it holds open) to whichever subreaper adopts it in time, or to PID 1 (seen in CI when
    the driver was SIGKILLed)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()


def _arm_write_workers(filesystem_async: object) -> None:
    """Megatron's writer forks one process per write bucket (`write_preloaded_data`) during every save. A rank
    killed in a save left them behind, blocked on the queues the rank held, with the resource tracker they keep
    open (seen locally after the driver's SIGKILL, issue 37: 2 of 20 kills). Each now dies with the rank (armed
    first thing in the forked worker; never in the rank itself, should the writer call it in process)."""
    writer = getattr(filesystem_async, "FileSystemWriterAsync", None)
    original = getattr(writer, "write_preloaded_data", None)
    if writer is None or not callable(original) or getattr(original, "hpc_rl_armed", False):
        return
    installer = os.getpid()

    def write_preloaded_data(*args: object, **kwargs: object) -> object:
        if os.getpid() != installer:
            _die_with_parent()
        return original(*args, **kwargs)

    write_preloaded_data.hpc_rl_armed = True  # type: ignore[attr-defined]
    writer.write_preloaded_data = staticmethod(write_preloaded_data)  # type: ignore[union-attr]


def keep_checkpoint_writer_through_sigterm() -> bool:
    """Megatron's checkpoint writer (megatron-core 0.16.1, `filesystem_async`) passes its results through a
    multiprocessing Manager it spawns: a fresh interpreter, with Python's default SIGTERM. Slurm signals every
    process of the step, so a scancel killed that Manager and the save the controller asked for in the grace
    failed with "Broken pipe" (measured on the local cluster). The Manager is started here instead, when the
    writer first asks for it, with SIGTERM ignored: it still ends with the rank (multiprocessing shuts it down
    at exit; a killed rank's is ended by torchrun's agent, a subreaper, and Slurm's SIGKILL). Whether Megatron's
    writer has that hook (another Megatron: nothing is changed)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return False
    if not callable(getattr(filesystem_async, "_get_write_results_queue", None)) \
            or not hasattr(filesystem_async, "_results_queue"):
        return False

    def results_queue() -> object:
        global _writer_manager
        if filesystem_async._results_queue is None:
            _writer_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            _writer_manager.start(initializer=_ignore_sigterm)
            filesystem_async._results_queue = _writer_manager.Queue()
        return filesystem_async._results_queue

    filesystem_async._get_write_results_queue = results_queue
    _arm_write_workers(filesystem_async)
    return True
