"""The fan-out of one pipelined weight update (begin, every bucket, end) to every engine at once, watched.

Owns reading the engines' answers in waves (`update_every_engine`: a shut `ReadGate` for all but the first
engine), naming an engine that stalls the update (`watch_fan_out`: /health probes when every engine went
silent), and, when an engine breaks the update, which engines count as broken (`WeightGroupBroken`). Used by
the broadcast transport (`transports.broadcast`); the benchmark `bench_admin_fanout` drives it alone. With the
answer workers (`rollout.answer_parse_workers`), they make the exchanges and read the answers (`fanout_workers`):
the rules here are the same. Not here:
the group, the trainer's side, or what the caller does with a broken engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hpc_rl.controller.engine_admin import (STUCK_NOTICE_S, BucketUpdate, EngineAdmin, EngineAdminError,
                                           PipelinedBuckets)
from hpc_rl.controller.stopping import stop_task
from hpc_rl.controller.transports.fanout_workers import WorkerUpdate, started_in_workers
from hpc_rl.protocol.http_client import EngineHTTPTransportError, ReadGate
from hpc_rl.rollout.answer_pool import AnswerPool
from hpc_rl.rollout.worker_fanout import GATE_PERIOD_S  # (one value for the loop's waves and the workers')

log = logging.getLogger(__name__)


class WeightGroupBroken(RuntimeError):
    """Engines broke a weight sync (one died or failed mid-update): the trainer's side of the group was
    aborted. `positions`: the engines (positions in the list updated; `engines`: their indices, once known)
    whose update failed or did not end within the grace period after the abort; the first error is the cause."""

    def __init__(self, message: str, positions: list[int]) -> None:
        super().__init__(message)
        self.positions = positions
        self.engines: list[int] = []


StuckEngine = Callable[[EngineAdmin, str], Awaitable[None]]
"""Called with an engine found stuck during a weight update and why (the fleet fails it: restart path)."""
STUCK_PROBE_CONCURRENCY = 64


async def watch_fan_out(admins: list[EngineAdmin], updates: list[asyncio.Future[None]], on_stuck: StuckEngine | None,
                        *, notice_s: float = STUCK_NOTICE_S, probe_timeout_s: float = STUCK_NOTICE_S) -> None:
    """While the update runs: when no engine has answered for `notice_s` (a broadcast waits for every
    engine, so one stuck engine silences all), say so, probe /health of each engine still updating, and
    name (and hand to `on_stuck`) every one that does not answer: the stuck one, not its waiting peers."""
    limit = asyncio.Semaphore(STUCK_PROBE_CONCURRENCY)
    reported: set[str] = set()

    async def probe(admin: EngineAdmin) -> bool:
        async with limit:
            return await admin.healthy(probe_timeout_s)

    while True:
        await asyncio.sleep(notice_s)
        waiting = [a for a, update in zip(admins, updates) if not update.done()]
        if not waiting or min(a.silent_for() for a in waiting) < notice_s:
            continue
        silent = min(a.silent_for() for a in waiting)
        healthy = await asyncio.gather(*(probe(a) for a in waiting))
        stuck = [a for a, ok in zip(waiting, healthy) if not ok and a.url not in reported]
        if not stuck:
            log.warning("weight update: no engine has answered for %.0f s; all %d still updating answer /health "
                        "(waiting on the trainer's broadcast)", silent, len(waiting))
        for admin in stuck:
            reported.add(admin.url)
            why = (f"stuck in a weight update: no answer for {silent:.0f} s and /health does not answer within "
                   f"{probe_timeout_s:g} s")
            log.warning("engine %s: %s", admin.url, why)
            if on_stuck is not None:
                await on_stuck(admin, why)


async def update_every_engine(admins: list[EngineAdmin], buckets: list[BucketUpdate], *,
                              on_stuck: StuckEngine | None = None, notice_s: float = STUCK_NOTICE_S,
                              on_break: Callable[[EngineAdminError], Awaitable[None]] | None = None,
                              settle_s: float = 0.0, pool: AnswerPool | None = None) -> None:
    """Every engine's pipelined update (begin, the buckets, end) at once: a bucket's broadcast completes only
    when every engine has joined it, so the engines cannot be taken a few at a time. The answers come in
    waves, each bucket's on every engine together: the first engine's are read as they come, every other
    engine's wait in its socket (a shut ReadGate) until the first engine is done, or GATE_PERIOD_S has
    passed, and are then read in one go. That is ~2 reads per engine instead of one per call (18 for
    Qwen3-4B), the event loop's read being most of the controller's CPU in a sync at 1,024 engines.
    Raises the first EngineAdminError, naming the engine and the call, as soon as it is read. Meanwhile
    `watch_fan_out` names (and hands to `on_stuck`) an engine that stalls the update. With `on_break`, an
    error first awaits it (it aborts the trainer's side of the group, so the broadcast the other engines are
    in ends), then every other engine gets `settle_s` to answer and WeightGroupBroken is raised.
    With `pool` (the answer workers), the workers make the exchanges, read the answers in the same waves and
    report each engine's outcome in a few batched frames (fanout_workers; the same errors, watch and breaks)."""
    gate = ReadGate()
    remote = WorkerUpdate(pool, admins, buckets) \
        if pool is not None and admins and all(isinstance(admin, EngineAdmin) for admin in admins) else None
    started = await started_in_workers(remote)
    if started is not None:
        updates = started
    else:
        remote = None
        buckets = PipelinedBuckets(buckets)  # encoded once for every engine
        if len(admins) > 1:
            gate.shut()
        updates = [asyncio.ensure_future(admin.weight_update(buckets, gate=gate) if index
                                         else admin.weight_update(buckets)) for index, admin in enumerate(admins)]
    first, every = updates[0], asyncio.gather(*updates)
    watchdog = asyncio.create_task(
        watch_fan_out(admins, updates, on_stuck, notice_s=notice_s, probe_timeout_s=notice_s),
        name="weight update watchdog")
    try:
        while remote is None and not every.done():
            await asyncio.wait((every, first), timeout=GATE_PERIOD_S, return_when=asyncio.FIRST_COMPLETED)
            gate.open()  # read what came; shut again until the first engine is done
            if first.done():
                break
            gate.shut()
        await every
    except EngineAdminError as error:
        gate.open()
        if on_break is None:
            raise
        await on_break(error)
        breaker = [position for position, admin in enumerate(admins) if getattr(admin, "url", None) == error.url]
        broken = sorted(set(breaker) | set(await _settled_failures(updates, settle_s)))
        raise WeightGroupBroken(str(error), broken) from error
    except asyncio.CancelledError:
        every.cancel()
        every.add_done_callback(lambda gathered: gathered.cancelled() or gathered.exception())  # read: no warning
        raise
    finally:
        gate.open()
        if remote is not None:
            remote.close()
        await stop_task(watchdog, "the weight update watchdog")


async def _settled_failures(tasks: list[asyncio.Future[None]], settle_s: float) -> list[int]:
    """Positions of the engines whose update did not end within `settle_s` (then cancelled: wedged in the
    broadcast) or ended without an answer (the process is gone). An engine that answered, even with the
    error the abort caused, is up: the next push gives it every bucket again."""
    _, late = await asyncio.wait(tasks, timeout=settle_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return [position for position, task in enumerate(tasks)
            if task.cancelled() or isinstance(getattr(task.exception(), "__cause__", None), EngineHTTPTransportError)]


