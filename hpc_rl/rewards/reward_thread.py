"""Custom reward functions off the controller's event loop, each call bounded by `rollout.reward_timeout`.

Owns `RewardThread`: one daemon thread running an asyncio loop of its own, where every custom reward call
(`async fn(args, sample)`, or a group's) runs; the controller awaits the call's future with a timeout.
A reward that blocks (a `time.sleep`, a lock, a busy loop in an `async def`) or awaits forever (a server
that never answers) then costs the controller nothing but that future: its loop keeps serving trainers,
engines, `status` and signals, and the call ends as `RewardTimeout` after the bound. The stuck call is
cancelled in its thread (an `await` notices at once; blocking code cannot be interrupted and keeps the
thread: later calls wait behind it and time out too, which is the run's error anyway). A call that times out
without ever starting names the call that holds the thread (`what`: "sample index 19"): the samples queued
behind a blocked one time out too, often first, and naming them sent users to the wrong sample (issue 37). The
thread is a daemon: a stuck reward never holds the process at exit.

Why one thread and not the controller's loop: slime runs `async_rm` on the rollout's loop; a blocking
reward there stalled a run forever, with SIGTERM and `status` unanswered (issue 24). Why not a process:
custom functions receive `Sample` objects and slime's `args`, and may keep module state (a client, a
cache) between calls, as they do in slime's process.
Not here: which rewards run here (`group.py`: custom functions), rule-based rewards (`pool.py`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class RewardTimeout(TimeoutError):
    """A reward call took longer than its bound."""


class RewardThread:
    """The thread custom rewards run on; `await call(make, timeout_s)` runs `make()` there."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._lock = threading.Lock()
        self.running: tuple[str, float] | None = None
        """(what, time.monotonic() it started) of the call running on the thread now; None between calls."""

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=self._serve, args=(loop,), name="custom rewards", daemon=True)
                thread.start()
                self._started.wait()
                self._loop = loop
        return self._loop

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(self._started.set)
        loop.run_forever()

    async def call(self, make: Callable[[], Awaitable[T]], timeout_s: float, *, what: str = "") -> T:
        """`await make()` on the reward thread; RewardTimeout after `timeout_s` (the call is cancelled there).
        `what` names the call ("sample index 19") in the timeout of a call queued behind it."""
        loop = self._ensure_started()
        started = threading.Event()

        async def run() -> T:
            started.set()
            self.running = (what or "a reward call", time.monotonic())
            try:
                return await make()
            finally:
                self.running = None

        future = asyncio.run_coroutine_threadsafe(run(), loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            future.cancel()
            holder = self.running
            if not started.is_set() and holder is not None:
                raise RewardTimeout(_queued_too_long(timeout_s, *holder)) from None
            raise RewardTimeout(_too_long(timeout_s)) from None
        except asyncio.CancelledError:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the thread's loop once its current work yields (a blocked call keeps it; it is a daemon)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)


async def bounded(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """An awaitable on the controller's loop (a remote or pooled reward) with the same bound."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise RewardTimeout(_too_long(timeout_s)) from None


def _too_long(timeout_s: float) -> str:
    return (f"no reward after {timeout_s:g} s (rollout.reward_timeout): the function blocks or waits on something "
            "that does not answer; fix it, or raise --reward-timeout")


def _queued_too_long(timeout_s: float, holder: str, since: float) -> str:
    return (f"no reward after {timeout_s:g} s (rollout.reward_timeout); this call never started: the reward thread "
            f"is held by the call for {holder}, running for {time.monotonic() - since:.0f} s, which blocks (a "
            "time.sleep, a lock or a busy loop in an async def); fix that, or raise --reward-timeout")
