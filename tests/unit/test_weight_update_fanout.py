"""The weight update's fan-out at scale: http_client.ReadGate (answers read in one go when the gate
opens), transports.fanout.update_every_engine against simulated engines, and no health probe of an engine busy
with an admin call. The echo server and simulated fleet helpers are test_engine_http_client's."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web

from hpc_rl.controller.engine_admin import BucketUpdate, EngineAdmin, EngineAdminError
from hpc_rl.controller.transports.fanout import update_every_engine
from hpc_rl.protocol.http_client import EngineConnections, ReadGate
from tests.unit.test_engine_http_client import echo_app, serve, sim_fleet
from tests.unit.waiting import wait_until


def test_a_shut_gate_leaves_answers_unread_without_timing_them_out() -> None:
    """The weight update's fan-out reads each engine's answers in one go when its ReadGate opens."""
    async def scenario() -> None:
        seen: list[tuple[int, str]] = []
        runner, url = await serve(echo_app(seen))
        pool = EngineConnections()
        gate = ReadGate()
        gate.shut()
        try:
            exchange = asyncio.create_task(pool.to(url).exchange(
                [("POST", "/one", b"{}"), ("POST", "/bad", b"{}"), ("POST", "/three", b"{}")], timeout_s=0.2, gate=gate))
            await wait_until(lambda: len(seen) == 3, what="the three requests at the engine")
            await asyncio.sleep(0.5)  # answered; only the first was read, the others held 2.5 timeouts long ...
            assert not exchange.done()  # ... and held time is not a timeout
            gate.open()
            answers = await asyncio.wait_for(exchange, 5)
            assert [status for status, _ in answers] == [200, 400, 200]
            assert orjson.loads(answers[2][1])["path"] == "/three"
            assert (await pool.to(url).request("GET", "/after", None, timeout_s=5))[0] == 200  # not gated
        finally:
            await pool.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_update_every_engine_names_a_failing_engine_behind_the_gate() -> None:
    async def scenario() -> None:
        async with sim_fleet(3) as (urls, pool):
            admins = [EngineAdmin(url, pool) for url in urls]
            buckets = [BucketUpdate.of(names=[f"w{i}"], dtypes=["bfloat16"], shapes=[[4, 4]], group_name="g",
                                       weight_version="3" if i == 3 else None, load_format=None) for i in range(4)]
            await update_every_engine(admins, buckets)
            for admin in admins:
                assert (await admin.model_info())["weight_version"] == "3"
            await admins[2].begin_weight_update()  # a session left open on a gated engine: its begin is refused
            with pytest.raises(EngineAdminError, match=f"{urls[2]}/begin_weight_update answered HTTP 400"):
                await update_every_engine(admins, buckets)

    asyncio.run(scenario())


def test_an_engine_busy_with_an_admin_call_is_not_health_probed() -> None:
    """During a long weight update the health round must not open a second connection to every engine."""
    async def scenario() -> None:
        seen: list[tuple[int, str]] = []
        app = web.Application()

        async def slow_pause(request: web.Request) -> web.Response:
            seen.append((id(request.transport), request.path))
            await asyncio.sleep(0.5)
            return web.json_response({"success": True})

        app.router.add_post("/pause_generation", slow_pause)
        runner, url = await serve(app)
        pool = EngineConnections()
        admin = EngineAdmin(url, pool)
        try:
            assert not admin.known_alive(5.0)  # never answered: probe it
            pause = asyncio.create_task(admin.pause())
            await asyncio.sleep(0.1)
            assert admin.known_alive(0.0)  # a call in flight watches the engine
            await pause
            assert admin.known_alive(5.0) and not admin.known_alive(0.0)
        finally:
            await pool.close()
            await runner.cleanup()

    asyncio.run(scenario())
