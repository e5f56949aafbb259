"""Ending asyncio tasks on purpose: cancel, wait, and say once what went wrong.

Owns `stop_task`, used wherever the controller or the driver stops a task whose outcome nobody else
will read (a rollout started ahead, the trainer side of a weight sync, the health monitor, the
controller's run at shutdown). Without it such a task may end with an exception that no one
retrieves, and asyncio then prints "Task exception was never retrieved" with no context, at an
arbitrary later moment. Not here: deciding WHEN to stop what (the loop, the fleet, the driver).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def stop_task(task: asyncio.Task[Any], what: str, *, timeout_s: float = 60.0,
                    log_error: bool = True) -> BaseException | None:
    """Cancel `task` unless it ended already, wait up to `timeout_s` for it to end, and return the error
    it ended with other than the cancellation (None if none). With `log_error`, that error is logged
    here, once, naming `what`; otherwise the caller reports it. A task still running after `timeout_s`
    is left behind with a callback that logs its eventual error, so it is never "not retrieved"."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=timeout_s)
    if not task.done():
        log.warning("%s did not stop within %.0f s of being cancelled; going on without it", what, timeout_s)
        task.add_done_callback(lambda late: log_task_error(late, what))
        return None
    if task.cancelled():
        return None
    error = task.exception()
    if error is not None and log_error:
        log_task_error(task, what)
    return error


def log_task_error(task: asyncio.Task[Any], what: str | None = None) -> None:
    """Log the error an ended task raised (nothing if it succeeded or was cancelled), naming the task."""
    if task.cancelled() or task.exception() is None:
        return
    error = task.exception()
    log.warning("%s ended with an error: %s: %s", what or task.get_name(), type(error).__name__, error,
                exc_info=error)
