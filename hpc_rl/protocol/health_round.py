"""One health round over many engines: a GET /health to each, all at once, with the same verdict rules wherever
the round runs (the controller's fleet, controller/engine_admin.healthy_all; an answer worker,
rollout/worker_probes.probe_round).

Owns the rules: an engine is healthy when it answers 200 within `timeout_s`; an engine with an idle kept-alive
connection is probed on it in one `RequestRound` (no coroutine or Future per engine: ~4x less CPU per probe); the
others (no connection to probe on, every one busy, or a fake in a unit test) take the caller's per-call probe,
`concurrency` at a time; a probe whose connection closed before the answer (the engine dropped an idle connection
as it was written) is made again per call, which reconnects; one that timed out is not (a stopped engine is failed
one timeout after the probe). Not here: which engines are probed, or what a failed verdict does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from hpc_rl.protocol.http_client import EngineConnection, RequestRound


async def health_round(connections: Sequence[EngineConnection | None], probe_one: Callable[[int], Awaitable[bool]],
                       timeout_s: float, *, concurrency: int = 64) -> list[bool]:
    """Whether each engine is healthy. `connections[i]`: engine i's connections to probe on in the round (None:
    per call only); `probe_one(i)`: engine i's per-call probe (reconnecting; True when it answered 200)."""
    round_ = RequestRound()
    sent = [connection is not None and round_.send(connection, "GET", "/health") for connection in connections]
    limit = asyncio.Semaphore(max(1, concurrency))

    async def one(index: int) -> bool:
        async with limit:
            return await probe_one(index)

    cold = asyncio.gather(*(one(index) for index, warm in enumerate(sent) if not warm))
    try:
        outcomes = await round_.wait(timeout_s)
    except BaseException:
        cold.cancel()
        raise
    slow = iter(await cold)
    results: list[bool] = []
    again: list[int] = []
    for index, (connection, warm) in enumerate(zip(connections, sent)):
        if not warm:
            results.append(next(slow))
            continue
        assert connection is not None
        outcome = outcomes.get(connection.url)
        results.append(isinstance(outcome, tuple) and outcome[0] == 200)
        if not isinstance(outcome, tuple) and connection.url not in round_.timed_out:
            again.append(index)  # the connection closed before the answer: once more, on a fresh one
    for index, healthy in zip(again, await asyncio.gather(*(one(i) for i in again))):
        results[index] = healthy
    return results
