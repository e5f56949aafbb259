"""The weight update's fan-out made by the answer workers (transports.fanout_workers, rollout.worker_fanout):
against simulated engines and small aiohttp fakes (named so), with a real AnswerPool (spawned workers). The same
errors as the loop's own fan-out, a transport failure and a worker dying mid-update break the sync (never a hang),
a stuck engine is named and not its peers, a cancelled update drops the workers' exchanges, and the controller's
own connections carry none of it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import orjson
import pytest
from aiohttp import web

from hpc_rl.controller.engine_admin import BucketUpdate, EngineAdmin, EngineAdminError
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.transports.broadcast import WeightGroup, push_weights_to_engines
from hpc_rl.controller.transports.fanout import WeightGroupBroken, update_every_engine
from hpc_rl.protocol.http_client import EngineConnections, EngineHTTPTransportError
from hpc_rl.rollout.answer_pool import AnswerPool
from tests.unit.test_engine_http_client import serve, sim_fleet, sim_fleet_server
from tests.unit.waiting import wait_until


def buckets(count: int = 4, version: str = "3") -> list[BucketUpdate]:
    return [BucketUpdate.of(names=[f"w{i}"], dtypes=["bfloat16"], shapes=[[4, 4]], group_name="g",
                            weight_version=version if i == count - 1 else None, load_format=None)
            for i in range(count)]


@asynccontextmanager
async def started(pool: AnswerPool) -> AsyncIterator[AnswerPool]:
    await pool.start()
    try:
        yield pool
    finally:
        pool.close()


class FakeUpdatingEngine:
    """A fake engine (aiohttp) for the update's calls: answers 200, except a 400 to the bucket numbered `fail_bucket`
    (1-based, as errors name it), and with `hang` set it answers nothing but /begin_weight_update (its buckets,
    /health, a join of a weight-update group that never completes) until released. `before_failing`, when set, is
    awaited before the 400 (a test holds it until the other engines are done)."""

    def __init__(self, *, fail_bucket: int = 0, hang: bool = False) -> None:
        self.fail_bucket, self.hang = fail_bucket, hang
        self.before_failing: Callable[[], Awaitable[None]] | None = None
        self.release = asyncio.Event()
        self.calls: list[str] = []
        self.bodies: list[bytes] = []
        self.closed_while_hanging = 0

    async def start(self) -> str:
        buckets_seen = 0

        async def call(request: web.Request) -> web.Response:
            nonlocal buckets_seen
            self.calls.append(request.path)
            self.bodies.append(await request.read())
            if request.path == "/update_weights_from_distributed":
                buckets_seen += 1
                if buckets_seen == self.fail_bucket:
                    if self.before_failing is not None:
                        await self.before_failing()
                    return web.json_response({"success": False, "message": "shape mismatch"}, status=400)
            if self.hang and request.path != "/begin_weight_update":
                try:
                    await asyncio.wait_for(self.release.wait(), 30)
                except asyncio.CancelledError:
                    self.closed_while_hanging += 1  # the client went away (aiohttp cancels the handler)
                    raise
                except asyncio.TimeoutError:
                    pass
            return web.json_response({"success": True})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", call)
        self.runner, url = await serve(app, handler_cancellation=True)
        return url

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()


def test_an_update_through_the_workers_reaches_every_engine_and_not_the_controllers_connections() -> None:
    async def scenario() -> None:
        async with sim_fleet(5) as (urls, connections), started(AnswerPool(2, api_key="k")) as pool:
            admins = [EngineAdmin(url, connections) for url in urls]
            await update_every_engine(admins, buckets(), pool=pool)
            assert all(admin.connection.progress_at() == float("-inf") for admin in admins)  # nothing on ours
            assert all(admin.known_alive(5.0) and not admin.in_flight for admin in admins)  # answered: no probe
            for admin in admins:
                assert (await admin.model_info())["weight_version"] == "3"
            await update_every_engine(admins, buckets(version="4"), pool=pool)  # again, on warm connections
            assert {(await admin.model_info())["weight_version"] for admin in admins} == {"4"}

    asyncio.run(scenario())


def test_an_engine_that_answers_an_error_is_named_as_the_loops_fan_out_names_it() -> None:
    async def scenario() -> None:
        fake = FakeUpdatingEngine(fail_bucket=2)
        fake_url = await fake.start()
        try:
            async with sim_fleet_server(3) as (server, urls, connections), \
                    started(AnswerPool(2, api_key="k")) as pool:
                messages = []
                for version, through in (("3", pool), ("4", None)):
                    fake.calls.clear()

                    async def peers_done(version: str = version) -> None:
                        """The first error ends the update (no on_break here) and drops what still runs: the
                        next update would find a slow peer's session open. The peers end theirs first."""
                        await wait_until(lambda: all(endpoint.engine.weight_version == version
                                                     and not endpoint.in_weight_update
                                                     for endpoint in server.endpoints.values()),
                                         what=f"the other engines' update to v{version} ended")

                    fake.before_failing = peers_done
                    admins = [EngineAdmin(url, connections) for url in [*urls, fake_url]]
                    with pytest.raises(EngineAdminError) as error:
                        await update_every_engine(admins, buckets(version=version), pool=through)
                    assert error.value.url == fake_url and error.value.__cause__ is None
                    await wait_until(lambda: fake.calls[-1:] == ["/end_weight_update"],  # the end call is still made
                                     what="the failing engine's /end_weight_update")
                    messages.append(str(error.value))
                    fake.fail_bucket += 4  # the next update's second bucket
                assert messages[0] == messages[1]
                assert messages[0].startswith(f"{fake_url}/update_weights_from_distributed (bucket 2 of 4) answered "
                                              "HTTP 400: ") and "shape mismatch" in messages[0]
                admins = [EngineAdmin(url, connections) for url in urls]
                await admins[2].begin_weight_update()  # a session left open: its begin is refused
                with pytest.raises(EngineAdminError, match=f"{urls[2]}/begin_weight_update answered HTTP 400"):
                    await update_every_engine(admins, buckets(), pool=pool)
        finally:
            await fake.stop()

    asyncio.run(scenario())


def test_no_listener_is_a_transport_failure_and_breaks_the_group_at_its_position() -> None:
    async def scenario() -> None:
        async with sim_fleet(3) as (urls, connections), started(AnswerPool(2, api_key="k")) as pool:
            dead = "http://127.0.0.1:9"  # (discard: nothing listens)
            admins = [EngineAdmin(url, connections) for url in [urls[0], dead, *urls[1:]]]
            aborted: list[str] = []

            async def on_break(error: EngineAdminError) -> None:
                aborted.append(str(error))

            with pytest.raises(WeightGroupBroken) as broken:
                await update_every_engine(admins, buckets(), pool=pool, on_break=on_break, settle_s=5.0)
            assert broken.value.positions == [1]  # the others answered: up
            cause = broken.value.__cause__
            assert isinstance(cause, EngineAdminError) and isinstance(cause.__cause__, EngineHTTPTransportError)
            assert aborted == [str(cause)] and str(cause).startswith(
                f"{dead}/begin_weight_update ... /end_weight_update failed: {dead}: cannot connect")

    asyncio.run(scenario())


def test_a_worker_dying_mid_update_fails_its_engines_as_transport_failures_without_a_hang() -> None:
    """Both of the killed worker's engines are fakes that hang (a simulated engine there could finish its whole update
    before the kill on a loaded machine, and rightly count as answered: a CI run once saw positions [0])."""
    async def scenario() -> None:
        fakes = [FakeUpdatingEngine(hang=True), FakeUpdatingEngine(hang=True)]
        fake_urls = [await fake.start() for fake in fakes]
        try:
            async with sim_fleet(3) as (urls, connections), started(AnswerPool(2, api_key="k")) as pool:
                order = [fake_urls[0], urls[0], fake_urls[1], urls[1]]  # engines go to workers 0, 1, 0, 1 in turn
                admins = [EngineAdmin(url, connections) for url in order]
                update = asyncio.create_task(update_every_engine(admins, buckets(), pool=pool,
                                                                 on_break=lambda error: asyncio.sleep(0), settle_s=5.0))
                await wait_until(lambda: "/update_weights_from_distributed" in fakes[0].calls,
                                 what="a bucket at the first fake")
                assert admins[0].in_flight  # the worker's call counts as the admin's
                assert pool.home(fake_urls[0]) == pool.home(fake_urls[1]) != pool.home(urls[0])
                victim = pool._slots[pool.home(fake_urls[0])]
                assert victim is not None
                victim.process.kill()
                with pytest.raises(WeightGroupBroken) as broken:
                    await asyncio.wait_for(update, 10)
                assert broken.value.positions == [0, 2]  # the killed worker's engines; worker 1's answered
                assert "ended before answering" in str(broken.value)
                assert not any(admin.in_flight for admin in admins)
                after = [*admins[1::2], EngineAdmin(urls[2], connections)]  # urls[2] is the fifth engine: worker 0
                await update_every_engine(after, buckets(), pool=pool)  # a new worker serves the next one
                assert pool.home(urls[2]) == pool.home(fake_urls[0]) and pool.restarts == 1
        finally:
            for fake in fakes:
                await fake.stop()

    asyncio.run(scenario())


def test_a_stuck_engine_is_named_not_its_peers_and_a_cancel_drops_its_exchange() -> None:
    async def scenario() -> None:
        fake = FakeUpdatingEngine(hang=True)
        fake_url = await fake.start()
        try:
            async with sim_fleet(2) as (urls, connections), started(AnswerPool(1, api_key="k")) as pool:
                admins = [EngineAdmin(url, connections, timeout_s=30.0) for url in [*urls, fake_url]]
                named: list[str] = []
                found = asyncio.Event()

                async def on_stuck(admin: EngineAdmin, why: str) -> None:
                    named.append(f"{admin.url}: {why}")
                    found.set()

                # (2 s: a peer the loaded machine keeps silent for a second is not taken for a stuck one)
                update = asyncio.create_task(update_every_engine(admins, buckets(), pool=pool, on_stuck=on_stuck,
                                                                 notice_s=2.0))
                await asyncio.wait_for(found.wait(), 30)
                assert len(named) == 1 and named[0].startswith(f"{fake_url}: stuck in a weight update: no answer for")
                # named for the silence the watchdog measured (not `silent_for()` now: on a loaded machine the fake's
                # answer to /begin_weight_update can reach the controller during the /health probe that follows)
                silent = re.search(r"no answer for (\d+) s", named[0])
                assert silent is not None and int(silent.group(1)) >= 2
                # the peers end their update (a loaded machine may still be reading their answers at the notice)
                await wait_until(lambda: not admins[0].in_flight and not admins[1].in_flight, what="the peers done")
                assert len(named) == 1 and admins[2].in_flight  # and only the stuck one is named, still in flight
                update.cancel()
                await asyncio.gather(update, return_exceptions=True)
                # the worker dropped the exchange: the engine sees its client go
                await wait_until(lambda: fake.closed_while_hanging > 0, what="the engine seeing its client go")
                assert fake.closed_while_hanging == 1 and not admins[2].in_flight
        finally:
            await fake.stop()

    asyncio.run(scenario())


def test_without_a_pool_the_loop_makes_the_exchanges() -> None:
    async def scenario() -> None:
        async with sim_fleet(2) as (urls, connections):
            admins = [EngineAdmin(url, connections) for url in urls]
            await update_every_engine(admins, buckets(), pool=None)
            assert all(admin.connection.answered_at > float("-inf") for admin in admins)

    asyncio.run(scenario())


def test_an_unusable_url_is_an_engine_error_not_a_silent_worker() -> None:
    async def scenario() -> None:
        async with started(AnswerPool(1)) as pool:
            connections = EngineConnections()
            admin = EngineAdmin("http://127.0.0.1:9", connections)
            admin.url = "ftp://nowhere"  # (EngineAdmin checked its own; the worker's client refuses this one)
            with pytest.raises(EngineAdminError, match="ftp://nowhere"):
                await asyncio.wait_for(update_every_engine([admin], buckets(), pool=pool), 10)
            await connections.close()

    asyncio.run(scenario())


def test_pause_and_continue_of_every_engine_go_through_the_workers_and_fail_the_same_engines() -> None:
    """`WeightUpdates.engines_call` with the pool: the calls are the workers', an engine whose call fails is failed
    with the message the loop's own calls give."""
    from tests.unit.test_weight_sync_recovery import weight_updates

    async def scenario() -> None:
        async with sim_fleet(3) as (urls, connections), started(AnswerPool(2, api_key="k")) as pool:
            dead = "http://127.0.0.1:9"
            reasons = []
            for through in (pool, None):
                admins = {i: EngineAdmin(url, connections) for i, url in enumerate([*urls, dead])}
                weights, fleet, _ = weight_updates(4, admins)  # type: ignore[arg-type]
                fleet.answer_pool = through  # (as rollout_stack sets the real fleet's)
                await weights.engines_call("pause", "in_place")
                assert fleet.failed == [3]
                reasons.append(fleet.registry.engines[3].last_error)
                assert all(admin.connection.progress_at() == float("-inf") for admin in admins.values()) \
                    == (through is not None)  # the workers' calls, not the controller's connections
                await weights.engines_call("resume_generation", engines=[0, 1, 2])
                assert fleet.failed == [3] and not any(admin.in_flight for admin in admins.values())
            assert reasons[0] == reasons[1]
            assert reasons[0].startswith(f"pause failed: {dead}/pause_generation failed: {dead}: cannot connect: ")

    asyncio.run(scenario())


def test_a_push_builds_the_group_through_the_workers_and_an_engine_lost_in_init_is_named() -> None:
    """`GroupPush` with the pool: each engine's /init_weights_update_group (its own rank offset), the destroy of the
    old group and the update are the workers'; an engine whose init fails is named (WeightGroupBroken) and the
    others' joins are dropped."""
    from tests.unit.test_weight_group_join import rank0_waiting_for_the_group

    async def scenario() -> None:
        joining = FakeUpdatingEngine(hang=True)
        joining_url = await joining.start()
        try:
            async with sim_fleet(2) as (urls, connections), started(AnswerPool(2, api_key="k")) as pool:
                events: list[str] = []
                channel = TrainerChannel(1)
                trainer = asyncio.create_task(rank0_waiting_for_the_group(channel, events, joins=True))
                engines = [EngineInfo(engine_index=i, url=url, tp_size=2) for i, url in enumerate(urls)]
                admins = {i: EngineAdmin(url, connections) for i, url in enumerate(urls)}
                group = WeightGroup()
                checks = EngineConnections(api_key="k")  # (the test's reads; `connections` stay the controller's)
                for version in (1, 2):
                    await push_weights_to_engines(version=version, channel=channel, engines=engines[:version],
                                                  admins=admins, group=group, backend="gloo", bucket_bytes=4,
                                                  timeout_s=30, pool=pool)  # v2: a new group of both
                    served = [(await EngineAdmin(url, checks).model_info())["weight_version"] for url in urls]
                    assert served[:version] == [str(version)] * version
                assert all(admin.connection.progress_at() == float("-inf") for admin in admins.values())
                await checks.close()
                engines += [EngineInfo(engine_index=2, url=joining_url),
                            EngineInfo(engine_index=3, url="http://127.0.0.1:9")]
                admins |= {2: EngineAdmin(joining_url, connections), 3: EngineAdmin("http://127.0.0.1:9", connections)}
                with pytest.raises(WeightGroupBroken) as broken:
                    await asyncio.wait_for(push_weights_to_engines(
                        version=3, channel=channel, engines=engines, admins=admins, group=group, backend="gloo",
                        bucket_bytes=4, timeout_s=30, pool=pool), 10)
                trainer.cancel()
                assert broken.value.engines == [3]
                assert "127.0.0.1:9/init_weights_update_group failed" in str(broken.value)
                # the workers dropped the joins still waiting
                await wait_until(lambda: joining.closed_while_hanging > 0, what="the join dropped")
                assert joining.closed_while_hanging == 1
                init = orjson.loads(joining.bodies[joining.calls.index("/init_weights_update_group")])
                assert init["rank_offset"] == 5 and init["world_size"] == 7 and init["group_name"].endswith("_3")
                assert events[-1] == "trainer AbortWeightGroupCommand"  # rank 0 had joined (joins=True)
        finally:
            await joining.stop()

    asyncio.run(scenario())


def test_workers_that_cannot_start_leave_the_calls_to_the_loop(caplog) -> None:
    async def scenario() -> None:
        async with sim_fleet(3) as (urls, connections):
            pool = AnswerPool(2, api_key="k")

            async def cannot_spawn(index: int, *, restart: bool) -> None:
                raise OSError("fork: cannot allocate memory")

            pool._spawn = cannot_spawn  # type: ignore[method-assign]
            admins = [EngineAdmin(url, connections) for url in urls]
            await update_every_engine(admins, buckets(), pool=pool)
            assert all(admin.connection.answered_at > float("-inf") for admin in admins)  # the loop's calls
            assert not any(admin.in_flight for admin in admins)
            from hpc_rl.controller.transports.fanout_workers import call_every_engine
            assert await call_every_engine(pool, admins, "pause", "retract") == [None, None, None]
            pool.close()

    asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if "cannot make" in r.getMessage()]
    assert len(warnings) == 2 and "fork: cannot allocate memory" in warnings[0]
