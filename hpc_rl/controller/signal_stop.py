"""Stopping on SIGTERM (`scancel`, preemption, a user's `kill`): save what can be saved within the grace.

    SIGTERM ──> loop.stop_requested: a rollout boundary reached meanwhile saves and stops (as on USR2)
            ──> wait, at most `grace_s`, until the trainer ranks run nothing (the loop generates, evaluates
                or talks to engines) or the loop has stopped by itself
            ──> cut the loop there: the rollout in flight is dropped (its prompts are still ahead of the
                data cursor the checkpoint stores, so a resume draws them again); a weight sync cut there
                (an engine stuck or dying in it: Slurm signals the engines too) has rank 0 abort its group
                first, or the save would wait behind broadcasts that never complete
            ──> save the rollout the ranks last trained, if it is not saved yet (bounded by what is left),
                and write its record if the cut came before it (the resume starts after it)
            ──> StopCommand to the ranks
    A rollout still training when the grace ends is cut without a new checkpoint (the last one stays).

Owns that sequence and the line that says what came of it. Not here: which signal means what and how
long the grace is (`hpc_rl.launch.signals`), the save itself (`checkpoints`), the ranks' side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hpc_rl.controller.run_loop import RunLoop
from hpc_rl.controller.stopping import stop_task
from hpc_rl.controller.trainer_channel import TrainerChannel

log = logging.getLogger(__name__)

POLL_S = 0.05


async def stop_with_checkpoint(loop: RunLoop | None, channel: TrainerChannel, run_task: asyncio.Task[Any],
                               grace_s: float) -> str:
    """Stop the run task at a point where the trainer's state is known, save it, stop the ranks; returns
    what happened, in a line for the user."""
    deadline = time.monotonic() + grace_s
    if loop is None:  # still starting: nothing trained, nothing to save
        await stop_task(run_task, "the controller's run", timeout_s=max(1.0, grace_s))
        return "stopped while starting; nothing to save"
    loop.stop_requested = True
    while not run_task.done() and not channel.idle and time.monotonic() < deadline:
        await asyncio.wait({run_task}, timeout=POLL_S)
    cut_busy = not run_task.done() and not channel.idle
    if not run_task.done():
        await stop_task(run_task, "the controller's run", timeout_s=max(1.0, deadline - time.monotonic()))
    if loop.stopped_for_requeue:
        outcome = f"checkpoint of rollout {loop.next_rollout_id - 1} saved at a rollout boundary"
    else:
        outcome = await _save_last_trained(loop, channel, deadline, cut_busy, grace_s)
    remaining = deadline - time.monotonic()
    if channel.failure is None and channel.idle and remaining > 0:
        try:
            await asyncio.wait_for(loop.trainers.stop("stopped by a signal"), remaining)
        except (TimeoutError, Exception) as error:  # noqa: BLE001 - the driver stops the step anyway
            log.warning("the trainer ranks did not take their stop command: %s", error)
    return outcome


async def _save_last_trained(loop: RunLoop, channel: TrainerChannel, deadline: float, cut_busy: bool,
                             grace_s: float) -> str:
    trained = loop.trainers.trained
    if channel.failure is not None:
        return f"no checkpoint: the trainer was lost ({channel.failure})"
    if cut_busy or not channel.idle or trained is None:
        if channel.running == "SaveCommand":  # the ranks go on: it may land before the processes are killed
            return (f"no new checkpoint confirmed: a save was still being written when the {grace_s:.0f} s grace "
                    "time ended (it counts only if it completes before the kill; a resume takes the newest "
                    "complete checkpoint)")
        return (f"no new checkpoint: the trainer ranks were busy ({channel.running or 'between commands'}) when the "
                f"{grace_s:.0f} s grace time ended (the last checkpoint is kept)")
    rollout_id, version = trained
    if loop.checkpoints.saved_rollout == rollout_id:
        return f"rollout {rollout_id} was already saved"
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return "no new checkpoint: no grace time left to save (the last checkpoint is kept)"
    try:  # a weight sync the stop cut (an engine stuck or dying in it) left rank 0 broadcasts that never complete:
        await asyncio.wait_for(loop.weights.transport.before_trainer_work(), remaining)  # the save would queue behind them
    except TimeoutError:
        return "no new checkpoint: aborting the weight-update group of the cut sync did not finish within the grace"
    except Exception as error:  # noqa: BLE001 - said, then the run stops as asked
        return f"no new checkpoint: aborting the cut sync's weight-update group failed: {type(error).__name__}: {error}"
    remaining = deadline - time.monotonic()
    try:
        metrics = await asyncio.wait_for(loop.checkpoints.save_if_due(rollout_id, version, stopping=True,
                                                                   unrecorded=loop.unrecorded), remaining)
    except TimeoutError:
        return f"no new checkpoint: saving rollout {rollout_id} did not finish within the grace time"
    except Exception as error:  # noqa: BLE001 - said, then the run stops as asked
        return f"no new checkpoint: saving rollout {rollout_id} failed: {type(error).__name__}: {error}"
    loop.record_cut_rollout(rollout_id)  # the resume starts after it: its record must be there
    return f"checkpoint of rollout {rollout_id} saved in {metrics.get('time/save', 0.0):.1f} s"
