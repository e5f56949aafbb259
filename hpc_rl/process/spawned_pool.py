"""A pool of spawned worker processes serving one asyncio service: created on first use, warmed at start,
stopped without waiting for a stuck worker.

Owns `SpawnedWorkers`, the `ProcessPoolExecutor` (spawn context: no fork of the controller's threads) behind the
controller's reward pool (`hpc_rl.rewards.pool`): its lazy creation, the warm-up call run once per worker at
start, running a call in it from the event loop, and a close that terminates the workers (a grader stuck in
sympy) instead of joining them first. (The answer workers, `hpc_rl.rollout.answer_pool`, are not calls in an
executor: each runs its own event loop of /generate exchanges.)
What a dead worker means (retry, fall back to the loop) stays with each service.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any


class SpawnedWorkers:
    """`workers` spawned processes; `warm_up` and `initializer` are module-level functions (they are pickled by
    name into each worker)."""

    def __init__(self, workers: int, *, warm_up: Callable[[], None],
                 initializer: Callable[[], None] | None = None) -> None:
        self.workers = workers
        self.warm_up, self.initializer = warm_up, initializer
        self._executor: ProcessPoolExecutor | None = None

    def executor(self) -> ProcessPoolExecutor:
        """The pool, created on first use (and again after `close`)."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(max_workers=self.workers, initializer=self.initializer,
                                                 mp_context=multiprocessing.get_context("spawn"))
        return self._executor

    async def start(self) -> None:
        """Start every worker and run `warm_up` in each."""
        loop = asyncio.get_running_loop()
        pool = self.executor()
        await asyncio.gather(*(loop.run_in_executor(pool, self.warm_up) for _ in range(self.workers)))

    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` in a worker (raises BrokenProcessPool if a worker died)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor(), function, *args)

    def pids(self) -> list[int]:
        """The workers started so far (none before first use or after `close`)."""
        processes = (getattr(self._executor, "_processes", None) or {}) if self._executor is not None else {}
        return [process.pid for process in processes.values()]

    def close(self) -> None:
        """Stop the workers now: queued calls are cancelled, running ones abandoned and their processes ended."""
        if self._executor is None:
            return
        processes = list((getattr(self._executor, "_processes", None) or {}).values())
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = None
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=5)
