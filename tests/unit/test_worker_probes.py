"""Health rounds probed in the answer workers (rollout/worker_probes.py, AnswerPool.probe_health) and the fleet
failing what they find (EngineFleet.answer_pool): the same verdicts as the controller's own round, one frame per worker,
and a worker that is gone never makes an engine look dead (the fleet probes those engines itself)."""

from __future__ import annotations

import asyncio
import os
import signal
import zlib

from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineState, Registry
from hpc_rl.protocol.http_client import EngineConnections
from hpc_rl.rollout.answer_pool import AnswerPool
from hpc_rl.rollout.worker_probes import probe_round
from tests.unit.waiting import wait_until

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
ERROR = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\ndown"


class FakeHealthEngineForTest(asyncio.Protocol):
    """A fake engine's /health over raw keep-alive HTTP/1.1. `mode`: "ok" (200), "error" (503), "stuck" (never
    answers), "drop" (closes the connection without answering), "drop once" (that, once; then "ok")."""

    def __init__(self, server: "FakeHealthServerForTest") -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections += 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            _, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            self.server.requests += 1
            assert self.transport is not None
            mode = self.server.mode
            if mode == "drop once":
                self.server.mode = "ok"
            if mode in ("drop", "drop once"):
                self.transport.close()
                return
            if mode != "stuck":
                self.transport.write(OK if mode == "ok" else ERROR)


class FakeHealthServerForTest:
    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.requests = 0
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> FakeHealthServerForTest:
        self._server = await asyncio.get_running_loop().create_server(lambda: FakeHealthEngineForTest(self),
                                                                      "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def closed_port_url() -> str:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"  # nothing listens there once closed


async def serving(pool: AnswerPool) -> None:
    """Wait until every worker of a started pool answers a round: a worker still starting (a spawned interpreter,
    seconds on a loaded machine) answers None, and the caller would probe itself, not what these tests check."""
    closed = [closed_port_url() for _ in range(pool.workers)]
    for index, url in enumerate(closed):
        pool._home[url] = index
    assert await pool.probe_health(closed, 30.0) == [False] * pool.workers  # refused: an answer from each worker
    for url in closed:
        del pool._home[url]


def test_a_round_gives_the_controllers_verdicts_and_retries_a_closed_connection_once() -> None:
    """probe_round (what a worker runs): 200 healthy; 503, refused, no answer in time unhealthy; a warm connection
    closed before the answer is probed once more on a fresh one (healthy when that answers, unhealthy when not)."""

    async def scenario() -> None:
        modes = ["ok", "error", "stuck", "ok", "ok"]
        servers = [await FakeHealthServerForTest(mode).start() for mode in modes]
        urls = [s.url for s in servers] + [closed_port_url()]
        engines = EngineConnections()
        try:
            start = asyncio.get_running_loop().time()
            assert await probe_round(engines, urls, 1.0) == [True, False, False, True, True, False]  # cold: per call
            assert asyncio.get_running_loop().time() - start < 15  # the stuck engine's probe timed out
            servers[3].mode, servers[4].mode = "drop once", "drop"
            before = [s.requests for s in servers]
            assert await probe_round(engines, urls, 1.0) == [True, False, False, True, False, False]
            assert [s.requests - b for s, b in zip(servers, before)] == [1, 1, 1, 2, 2]  # the dropped: once more
            assert servers[0].connections == 1  # the healthy engine's connection stayed warm
        finally:
            await engines.close()
            for server in servers:
                await server.stop()

    asyncio.run(scenario())


def test_the_pool_probes_in_its_workers_one_frame_each_and_says_none_when_a_worker_is_gone() -> None:
    async def scenario() -> None:
        servers = [await FakeHealthServerForTest(mode).start() for mode in ("ok", "error", "ok", "stuck", "ok")]
        urls = [s.url for s in servers]
        pool = AnswerPool(2)
        await pool.start()
        await serving(pool)
        for index, url in enumerate(urls[:4]):
            pool._home[url] = index % 2  # engines 0, 2 are worker 0's (as their posts made them), 1, 3 worker 1's
        spare = zlib.crc32(urls[4].encode()) % 2  # engine 4 never generated: the worker its URL picks
        try:
            assert await pool.probe_health(urls, 1.0) == [True, False, True, False, True]
            assert [s.requests for s in servers] == [1, 1, 1, 1, 1] and urls[4] not in pool._home
            assert await pool.probe_health(urls[:3], 5.0) == [True, False, True]
            assert servers[0].connections == 1  # probed again on the worker's warm connection
            servers[1].mode = "stuck"  # worker 1 dies in the middle of a round
            asked = servers[1].requests
            probing = asyncio.ensure_future(pool.probe_health(urls, 3.0))
            await wait_until(lambda: servers[1].requests > asked, what="worker 1 probing its stuck engine")
            os.kill(pool._slots[1].process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            gone = [True, None, True, None, None if spare == 1 else True]  # None: not probed, not dead
            assert await asyncio.wait_for(probing, 20) == gone
            assert await pool.probe_health(urls[:2], 1.0) == [True, None]  # no worker 1 now
            pool.close()
            assert await pool.probe_health(urls, 0.5) == [None] * 5
        finally:
            pool.close()
            for server in servers:
                await server.stop()

    asyncio.run(scenario())


def test_the_fleet_fails_exactly_the_unhealthy_engine_with_or_without_its_workers() -> None:
    """Probed in the workers, the controller opens no connection of its own; with the pool's worker gone (then the
    pool closed), the fleet probes the engines itself: the same engine fails, with the same message."""

    async def scenario() -> None:
        servers = [await FakeHealthServerForTest().start() for _ in range(4)]
        registry = Registry(trainer_world_size=1, num_engines=4)
        fleet = EngineFleet(registry, None, api_key=None, restart=None, max_restarts=0, health_interval_s=3600,
                            health_timeout_s=1.0)
        pool = AnswerPool(1)
        await pool.start()
        await serving(pool)
        fleet.answer_pool = pool
        await fleet.start()
        try:
            for index, server in enumerate(servers):
                await fleet.register(index, server.url, serving=True)
            await fleet.check_health()
            assert [e.state for e in registry.engines.values()] == [EngineState.SERVING] * 4
            assert all(server.requests == 1 for server in servers)
            assert not any(fleet.connections.to(s.url)._links for s in servers)  # type: ignore[union-attr]

            servers[2].mode = "stuck"
            await fleet.check_health()
            failed = [i for i, e in registry.engines.items() if e.state == EngineState.FAILED]
            assert failed == [2] and registry.engines[2].last_error == "health check failed"

            os.kill(pool.pids()[0], signal.SIGKILL)
            await wait_until(lambda: not pool.pids(), what="the killed worker noticed")
            servers[1].mode = "error"
            before = [s.requests for s in servers]
            await fleet.check_health()  # no worker: the fleet's own probes
            failed = [i for i, e in registry.engines.items() if e.state == EngineState.FAILED]
            assert failed == [1, 2]
            assert [s.requests - b for s, b in zip(servers, before)] == [1, 1, 0, 1]  # failed ones are not probed
            assert fleet.connections.to(servers[0].url)._links  # type: ignore[union-attr]
            pool.close()
            fleet.health_interval_s = 0.2  # engine 0 and 3's answers to the fleet no longer vouch for them
            await asyncio.sleep(0.3)
            servers[3].mode = "error"
            await fleet.check_health()  # a closed pool: the same
            assert [i for i, e in registry.engines.items() if e.state == EngineState.FAILED] == [1, 2, 3]
            assert servers[0].requests - before[0] == 2
        finally:
            pool.close()
            await fleet.close()
            for server in servers:
                await server.stop()

    asyncio.run(scenario())
