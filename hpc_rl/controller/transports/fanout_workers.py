"""A weight sync's fan-outs made by the answer workers (`rollout.answer_parse_workers` > 0): the pipelined update
`transports.fanout.update_every_engine` waits on, and the one-call fan-outs around it (pause, continue, the new
group's destroy and init calls, the colocated memory moves), instead of one exchange per engine on the
controller's connections.

Owns `WorkerCalls` (and `WorkerUpdate`, the update's): one Future per engine, done when its worker reports the
engine's outcome, failed with the EngineAdminError the controller's own call would raise (the same message naming
the engine and the call or bucket; a transport failure, including the worker ending, with the
EngineHTTPTransportError as its cause, as `_settled_failures` reads it); and each engine's `EngineAdmin`
bookkeeping meanwhile (a call in flight whose progress is the worker's news, so the health round and
`watch_fan_out` see the engines as before). `call_every_engine` and `calls_in_workers` choose: the workers where
they can make the call (`engine_admin.FAN_OUT_CALLS`), the loop otherwise.

Why: at 1,024 engines the controller parsed ~18,400 answers per update on its loop (bench_scale's syncCPU
~0.1 s) and ~1,024 per pause or continue (~0.05 s each, bench_admin_fanout); now it reads a few batched frames
per worker. The requests, their order on each engine's connection and the engines' answers are unchanged. Does
not own: the frames and the worker's side (rollout.worker_fanout), the sync's rules (transports.fanout,
transports.broadcast).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from hpc_rl.controller.engine_admin import (FAN_OUT_CALLS, BucketUpdate, EngineAdmin, EngineAdminError,
                                           RemoteProgress, pipeline_span, status_error, weight_update_call,
                                           weight_update_calls)
from hpc_rl.protocol.http_client import EngineHTTPTransportError, Pipeline
from hpc_rl.rollout.answer_pool import AnswerPool
from hpc_rl.rollout.worker_fanout import Outcome, PipelineFanOut

log = logging.getLogger(__name__)


class WorkerCalls:
    """The same requests to every engine (pipelined on one connection each), made by the answer workers: one
    Future per engine, failed with the EngineAdminError the controller's own call would raise."""

    def __init__(self, pool: AnswerPool, admins: list[EngineAdmin], calls: list[tuple[str, str, bytes]], *,
                 timeout_s: float | None = None, notice: bool = False, own_bodies: list[bytes] | None = None) -> None:
        """`own_bodies`: one call, with each engine's own body."""
        self.admins, self.pool, self.notice = admins, pool, notice
        self.requests = Pipeline(calls)  # (for the names in errors)
        self.span = pipeline_span(self.requests)
        loop = asyncio.get_running_loop()
        self.updates: list[asyncio.Future[None]] = [loop.create_future() for _ in admins]
        self.progress: dict[int, RemoteProgress] = {}
        """Per worker: the latest answer it read from its engines still updating."""
        self._open: set[int] = set()
        self.fan_out = PipelineFanOut(pool, [admin.url for admin in admins], calls,
                                      timeout_s or max(admin.timeout_s for admin in admins),
                                      on_outcome=self._outcome, on_progress=self._progress, own_bodies=own_bodies)

    def call_name(self, index: int) -> str:
        """How errors name request `index`."""
        return self.requests.keys[index][1]

    async def start(self) -> list[asyncio.Future[None]]:
        """Send it; each engine's Future (done, or failed with its EngineAdminError)."""
        for position, admin in enumerate(self.admins):
            admin.begin_elsewhere(self.span, self._worker_progress(position), notice=self.notice)
            self._open.add(position)
        try:
            await self.fan_out.start()
        except BaseException:
            self.close()
            raise
        return self.updates

    def close(self) -> None:
        """However the update ended: the workers drop what they still run (an engine left waiting after an abort's
        grace period, a cancelled sync) and each admin's call ends."""
        self.fan_out.cancel()
        for position in sorted(self._open):
            self._end(position, answered=False)
            update = self.updates[position]
            if not update.done():
                update.cancel()

    def _end(self, position: int, *, answered: bool) -> None:
        if position in self._open:
            self._open.discard(position)
            self.admins[position].end_elsewhere(self.span, answered=answered)

    def _outcome(self, position: int, outcome: Outcome) -> None:
        admin, update = self.admins[position], self.updates[position]
        self._end(position, answered=outcome is None or outcome[0] == "status")
        if update.done():
            return
        if outcome is None:
            update.set_result(None)
        elif outcome[0] == "status":
            _, index, status, body_head = outcome
            update.set_exception(status_error(admin.url, self.call_name(index), status, body_head))
        else:
            cause = EngineHTTPTransportError(outcome[3])
            error = EngineAdminError(f"{admin.url}{self.span} failed: {cause}", url=admin.url)
            error.__cause__ = cause
            update.set_exception(error)

    def _worker_progress(self, position: int) -> RemoteProgress:
        worker = self.pool.home(self.admins[position].url)
        progress = self.progress.get(worker)
        if progress is None:
            progress = self.progress[worker] = RemoteProgress(float("-inf"))
        return progress

    def _progress(self, positions: list[int], at: float) -> None:
        progress = self._worker_progress(positions[0])  # (one worker's engines)
        progress.at = max(progress.at, at)


class WorkerUpdate(WorkerCalls):
    """Every engine's pipelined update (begin, the buckets, end), made by the answer workers."""

    def __init__(self, pool: AnswerPool, admins: list[EngineAdmin], buckets: list[BucketUpdate]) -> None:
        # not noticed per engine: update_every_engine watches the fan-out as a whole (as EngineAdmin.weight_update)
        super().__init__(pool, admins, weight_update_calls(buckets))

    def call_name(self, index: int) -> str:
        return weight_update_call(self.requests, index)


async def started_in_workers(calls: WorkerCalls | None) -> list[asyncio.Future[None]] | None:
    """`calls.start()`: each engine's Future; None, with nothing sent, when `calls` is None or a worker cannot be
    started (logged): the caller then makes the calls on the loop, as without a pool."""
    if calls is None:
        return None
    try:
        return await calls.start()
    except Exception as error:  # (a worker that cannot be spawned)
        log.warning("the answer workers cannot make %s (%s: %s); the controller makes the calls", calls.span,
                    type(error).__name__, error)
        return None


def calls_in_workers(pool: AnswerPool | None, admins: list[EngineAdmin], method: str,
                     each: list[dict[str, Any]]) -> WorkerCalls | None:
    """`EngineAdmin.method(**each[i])` of every engine i, to be made by the answer workers (each with its own
    body: `start()` it, `close()` it however it ends); None when they cannot: no pool, a `method` that is not one
    POST (`engine_admin.FAN_OUT_CALLS`), or an admin that is not an EngineAdmin (a test's fake)."""
    request = FAN_OUT_CALLS.get(method)
    if pool is None or request is None or not admins or not all(isinstance(admin, EngineAdmin) for admin in admins):
        return None
    paths_and_bodies = [request(**arguments) for arguments in each]
    path = paths_and_bodies[0][0]
    return WorkerCalls(pool, admins, [("POST", path, b"")], notice=True,
                       own_bodies=[orjson.dumps(body) for _, body in paths_and_bodies])


async def call_every_engine(pool: AnswerPool | None, admins: list[EngineAdmin], method: str,
                            *args: Any) -> list[BaseException | None]:
    """`EngineAdmin.method(*args)` on every engine at once: each engine's error (None when it answered 200), as
    `asyncio.gather(..., return_exceptions=True)` of the calls gives. Made by the answer workers when they can (a
    call in `engine_admin.FAN_OUT_CALLS`, real admins: the loop reads a few frames), else by the admins on the
    loop. (The answers' bodies are not returned: those calls return nothing.)"""
    request = FAN_OUT_CALLS.get(method)
    if pool is None or request is None or not admins or not all(isinstance(admin, EngineAdmin) for admin in admins):
        return list(await asyncio.gather(*(getattr(admin, method)(*args) for admin in admins), return_exceptions=True))
    path, body = request(*args)
    calls = WorkerCalls(pool, admins, [("POST", path, orjson.dumps(body))], notice=True)
    futures = await started_in_workers(calls)
    if futures is None:
        return list(await asyncio.gather(*(getattr(admin, method)(*args) for admin in admins), return_exceptions=True))
    try:
        return list(await asyncio.gather(*futures, return_exceptions=True))
    finally:
        calls.close()
