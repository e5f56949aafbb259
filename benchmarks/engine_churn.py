"""Engines joining and leaving a running controller mid-rollout, as engine jobs' agents do (bench_scale.py --join/--leave).

Each joiner and each leaver speaks the controller's authenticated protocol on a connection of its own (what
`hpc_rl.launch.engine_agent` does per engine): `EngineJoin` for the simulated engines not registered at start, and
`EngineLeave` for engines that serve (the first `leave` of the run's own), sent while a rollout generates, so their
requests in flight are aborted and requeued. Handshakes go at most HANDSHAKES_AT_ONCE at a time (the server drops the
oldest of more than 32 unauthenticated connections). The counts and the controller's measured times
(`EngineMembership.records`) come back in `ChurnResult`.

With `hold_leavers` (tests: tests/integration/test_bench_scale.py), the leavers are paused in place while they hold
requests, then left: they finish nothing from the pause on, so requests are in flight on them when the controller
takes the leave. Without it (the measured runs) a leave can come as the rollout's last answers do, and then
requeues none.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.protocol import Hello
from hpc_rl.protocol.connection import connect
from hpc_rl.protocol.messages import EngineJoin, EngineJoined, EngineLeave, EngineLeft
from hpc_rl.protocol.secret import Secret

HANDSHAKES_AT_ONCE = 16


@dataclass
class ChurnResult:
    joined: int = 0
    left: int = 0
    requeued: int = 0
    """Requests in flight on the leaving engines when they left (aborted, then resumed on others)."""
    first_request_s: list[float] = field(default_factory=list)
    """Per joiner: its registration to the first request the controller sent it."""
    drain_s: list[float] = field(default_factory=list)
    """Per leaver: its abort to the moment every request it held was back with the rollout."""
    join_wall_s: float = 0.0
    leave_wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        def spread(values: list[float]) -> str:
            return f"p50 {statistics.median(values):.3f} s, max {max(values):.3f} s" if values else "none"

        return {"joined": self.joined, "left": self.left, "requeued": self.requeued,
                "first_request": spread(self.first_request_s), "first_request_seen": len(self.first_request_s),
                "drain": spread(self.drain_s), "join_wall_s": round(self.join_wall_s, 2),
                "leave_wall_s": round(self.leave_wall_s, 2)}


async def _request(address: tuple[str, int], secret: Secret, message: Any, gate: asyncio.Semaphore) -> Any:
    async with gate:
        conn = await connect(*address, secret, Hello(role="engine"), timeout=60.0)
    try:
        return await conn.request(message, timeout=600.0)
    finally:
        await conn.close()


async def generating(controller: Any, rollout_id: int = 0, timeout_s: float = 600.0) -> None:
    """Until rollout `rollout_id` (or a later one) generates: the rollout client has requests in flight."""
    deadline = time.monotonic() + timeout_s
    while not (controller.client is not None and controller.client.in_flight and controller.loop is not None
               and controller.loop.next_rollout_id >= rollout_id):
        if time.monotonic() > deadline:
            raise RuntimeError("no rollout generated within the wait")
        await asyncio.sleep(0.05)


async def holding(controller: Any, leavers: list[int], timeout_s: float = 600.0) -> None:
    """Once `leavers` hold requests of the controller's, pause them in place (they finish nothing from then on) and
    return if they still hold one: it stays in flight on them until their leave aborts it. (A weight sync's continue
    resumes them; in async mode one can end between this and the leave, which waits for it: a window of one poll.)"""
    urls = [controller.registry.engines[index].url for index in leavers]
    deadline = time.monotonic() + timeout_s
    while True:
        while not any(controller.client.in_flight_on(url) for url in urls):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the leavers {leavers} were sent no request within {timeout_s:.0f} s")
            await asyncio.sleep(0.01)
        await asyncio.gather(*(controller.fleet.admins[index].pause("in_place") for index in leavers))
        if any(controller.client.in_flight_on(url) for url in urls):
            return


async def churn(controller: Any, secret: Secret, *, join_urls: list[str], leave: int, tp_size: int,
                rollout_id: int = 1, hold_leavers: bool = False) -> ChurnResult:
    """While rollout `rollout_id` generates (1: after the first weight sync, so joiners get the weights before they
    serve): every `join_urls` engine joins, then `leave` serving engines leave (all at once; with `hold_leavers`,
    paused in place first and left once they hold requests: `holding`)."""
    result = ChurnResult()
    address = ("127.0.0.1", controller.address[1])
    gate = asyncio.Semaphore(HANDSHAKES_AT_ONCE)
    await generating(controller, rollout_id)
    start = time.perf_counter()
    replies = await asyncio.gather(*(_request(address, secret, EngineJoin(url=url, tp_size=tp_size, job_id="bench",
                                                                          name=f"joiner-{i}"), gate)
                                     for i, url in enumerate(join_urls)))
    result.join_wall_s = time.perf_counter() - start
    joined = [reply.engine_index for reply in replies if isinstance(reply, EngineJoined)]
    result.joined = len(joined)
    await generating(controller, rollout_id)
    leavers = [engine.engine_index for engine in controller.registry.serving_engines()
               if engine.engine_index not in joined][:leave]
    if hold_leavers:
        await holding(controller, leavers)
    start = time.perf_counter()
    replies = await asyncio.gather(*(_request(address, secret, EngineLeave(engine_index=index, reason="bench churn"),
                                              gate) for index in leavers))
    result.leave_wall_s = time.perf_counter() - start
    for reply in replies:
        if isinstance(reply, EngineLeft):
            result.left += 1
            result.requeued += reply.requeued
            result.drain_s.append(reply.drain_s)
    return result


def first_requests(controller: Any, result: ChurnResult) -> None:
    """Fill in the joiners' registration -> first request times the controller measured (after the run)."""
    result.first_request_s = [record["first_request_s"] for record in controller.membership.records.values()
                              if record.get("first_request_s") is not None]
