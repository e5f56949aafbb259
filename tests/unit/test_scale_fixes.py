"""Bottlenecks bench_scale.py found at 256-1,024 simulated engines, each pinned by a test."""

from __future__ import annotations

import asyncio
import time

from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry
from hpc_rl.rollout.generate import GenerationSession


def test_engine_urls_are_rebuilt_only_after_a_change(monkeypatch) -> None:
    """The rollout client asks for the serving URLs on every request: no O(N) rebuild per call."""
    registry = Registry(trainer_world_size=1, num_engines=3)
    for index in range(3):
        registry.add_engine(EngineInfo(engine_index=index, url=f"http://e{index}", state=EngineState.SERVING))
    builds = []
    original = registry.serving_engines
    monkeypatch.setattr(registry, "serving_engines", lambda: builds.append(1) or original())
    assert [registry.engine_urls() for _ in range(5)] == [("http://e0", "http://e1", "http://e2")] * 5
    assert len(builds) == 1
    first = registry.engine_urls()
    assert registry.engine_urls() is first  # the same tuple until a change: readers tell "unchanged" by identity
    registry.set_engine_state(1, EngineState.FAILED, "health check failed")
    assert registry.engine_urls() == ("http://e0", "http://e2") and registry.engine_urls() is not first
    registry.add_engine(EngineInfo(engine_index=1, url="http://e1b", state=EngineState.SERVING))
    assert registry.engine_urls() == ("http://e0", "http://e1b", "http://e2")


def test_engine_loads_reads_an_unchanged_url_tuple_without_comparing_it() -> None:
    from hpc_rl.rollout.engine_loads import EngineLoads

    loads = EngineLoads()
    urls = ("http://a", "http://b")
    assert loads.pick(urls, 2, lambda url: False) == "http://a"
    loads.change("http://a", 1)
    loads._member_list.append("sentinel")  # a compare would now see a change and rebuild; identity skips it
    assert loads.pick(urls, 2, lambda url: False) == "http://b" and loads._member_list[-1] == "sentinel"
    changed = ("http://a", "http://c")  # a new tuple (the registry changed): read again
    loads.change("http://a", 1)
    assert loads.pick(changed, 3, lambda url: False) == "http://c" and loads._member_list == list(changed)
    assert loads.pick(["http://a", "http://b"], 3, lambda url: False) == "http://b"  # lists: compared every time


class CountingRouterForTest:
    """A fake of sglang-router membership that records each batch it is given."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def add_workers(self, urls: list[str]) -> None:
        self.batches.append(list(urls))

    def remove_worker(self, url: str) -> None:
        pass


def test_registrations_made_together_reach_the_router_as_one_batch() -> None:
    """Each registration used to wait for the router's full worker list on its own: O(N^2) at start-up."""

    async def scenario() -> None:
        router = CountingRouterForTest()
        fleet = EngineFleet(Registry(trainer_world_size=1, num_engines=50), router, api_key=None, restart=None,
                            max_restarts=0, health_interval_s=3600)
        await fleet.start()
        try:
            await asyncio.gather(*(fleet.register(i, f"http://127.0.0.1:{9000 + i}", serving=True) for i in range(50)))
        finally:
            await fleet.close()
        assert router.batches == [[f"http://127.0.0.1:{9000 + i}" for i in range(50)]]
        assert len(fleet.registry.serving_engines()) == 50

    asyncio.run(scenario())


class SlowProbeAdminForTest:
    """A fake of EngineAdmin whose /health takes 0.2 s (a loaded engine); engine 3 does not answer. `probing`
    counts the probes in flight across all of them, `most` the peak."""

    probing = 0
    most = 0

    def __init__(self, index: int) -> None:
        self.index = index
        self.probed = False
        self.in_flight: list[str] = []  # no admin call in flight

    def known_alive(self, seconds: float, now: float | None = None) -> bool:
        return self.index == 5  # engine 5 just answered a weight-update call: no probe needed

    async def healthy(self, timeout_s: float) -> bool:
        self.probed = True
        cls = type(self)
        cls.probing += 1
        cls.most = max(cls.most, cls.probing)
        try:
            await asyncio.sleep(0.2)
        finally:
            cls.probing -= 1
        return self.index != 3


def test_a_health_round_probes_engines_concurrently() -> None:
    """Sequential probes made a round over 1,024 engines take minutes and starved the event loop."""

    async def scenario() -> None:
        registry = Registry(trainer_world_size=1, num_engines=40)
        fleet = EngineFleet(registry, None, api_key=None, restart=None, max_restarts=0, health_interval_s=3600,
                            health_concurrency=16)
        await fleet.start()
        try:
            SlowProbeAdminForTest.probing = SlowProbeAdminForTest.most = 0
            for index in range(40):
                registry.add_engine(EngineInfo(engine_index=index, url=f"http://e{index}", state=EngineState.SERVING))
                fleet.admins[index] = SlowProbeAdminForTest(index)  # type: ignore[assignment]
            start = time.perf_counter()
            await fleet.check_health()
            took = time.perf_counter() - start
        finally:
            await fleet.close()
        # 16 at a time, started together (a sleep of 0.2 s each is far longer than starting them): not one by one
        assert SlowProbeAdminForTest.most == 16, f"at most {SlowProbeAdminForTest.most} probes at once"
        assert took < 6.0, f"40 probes of 0.2 s took {took:.1f} s: not concurrent (sequential: 8 s)"
        assert [e.engine_index for e in registry.engines.values() if e.state == EngineState.FAILED] == [3]
        assert [i for i, admin in fleet.admins.items() if not admin.probed] == [5]  # type: ignore[attr-defined]

    asyncio.run(scenario())


class DrainingClientForTest:
    """A fake of EngineClient for GenerationSession.stop: counts abort_all rounds."""

    def __init__(self) -> None:
        self.abort_rounds = 0

    async def wake_waiters(self) -> None:
        pass

    async def abort_all(self) -> int:
        self.abort_rounds += 1
        return 1


def test_stop_aborts_once_while_the_aborted_requests_come_back() -> None:
    """stop() re-sent abort_all to every engine each time one response came back: with thousands in
    flight on 1,024 engines, a storm of 1,024-call rounds while they drained."""

    async def scenario() -> None:
        client = DrainingClientForTest()
        session = GenerationSession(client)  # type: ignore[arg-type]
        session.in_flight = {f"r{i}" for i in range(200)}

        async def drain() -> None:
            for rid in sorted(session.in_flight):
                await asyncio.sleep(0.002)
                session._done(rid)

        drained = asyncio.create_task(drain())
        # answers every 2 ms: re-aborting only after 2 s without one, a loaded machine's stall is not taken for
        # silence (with 0.2 s a loaded run re-aborted twice); the old storm re-aborted at every answer
        assert await session.stop(timeout_s=10.0, abort_every_s=2.0)
        await drained
        assert client.abort_rounds == 1

        late = GenerationSession(client)  # type: ignore[arg-type]
        late.in_flight = {"missed"}  # reached its engine just after the abort: nothing comes back
        client.abort_rounds = 0
        asyncio.get_running_loop().call_later(0.5, late._done, "missed")
        assert await late.stop(timeout_s=10.0, abort_every_s=0.2)
        assert client.abort_rounds >= 2  # re-aborted once nothing came back for abort_every_s

    asyncio.run(scenario())


class AnswerlessAdminForTest:
    """A fake of EngineAdmin for an engine that never answers /health (still compiling, or dead)."""

    def __init__(self) -> None:
        self.probes = 0
        self.in_flight: list[str] = []  # no admin call in flight

    def known_alive(self, seconds: float, now: float | None = None) -> bool:
        return False

    async def healthy(self, timeout_s: float) -> bool:
        self.probes += 1
        return False


def test_slimes_health_check_flags_set_the_fleets_checks() -> None:
    """--rollout-health-check-first-wait: no probe until that long after an engine registered; then a silent
    engine is failed. --rollout-health-check-interval/-timeout reach the fleet the controller builds."""
    from hpc_rl.config import load_config
    from hpc_rl.controller.app import Controller
    from hpc_rl.protocol import Secret

    config = load_config([], ["--use-fault-tolerance", "--rollout-health-check-interval", "7",
                              "--rollout-health-check-timeout", "3", "--rollout-health-check-first-wait", "0.3"])
    fleet = Controller(config, secret=Secret(b"k" * 32), router=None, router_url=None).fleet  # builds nothing yet
    assert (fleet.health_interval_s, fleet.health_timeout_s, fleet.health_first_wait_s) == (7.0, 3.0, 0.3)

    async def scenario() -> None:
        registry = Registry(trainer_world_size=1, num_engines=1)
        fleet = EngineFleet(registry, None, api_key=None, restart=None, max_restarts=0, health_interval_s=3600,
                            health_first_wait_s=0.3)
        await fleet.start()
        try:
            await fleet.register(0, "http://127.0.0.1:9", serving=True)
            admin = AnswerlessAdminForTest()
            fleet.admins[0] = admin  # type: ignore[assignment]
            await fleet.check_health()
            assert admin.probes == 0 and registry.engines[0].state == EngineState.SERVING  # in its first wait
            await asyncio.sleep(0.35)
            await fleet.check_health()
            assert admin.probes == 1 and registry.engines[0].state == EngineState.FAILED
        finally:
            await fleet.close()

    asyncio.run(scenario())


def test_an_engine_that_answered_a_generate_within_the_interval_is_not_probed() -> None:
    async def scenario() -> None:
        registry = Registry(trainer_world_size=1, num_engines=2)
        fleet = EngineFleet(registry, None, api_key=None, restart=None, max_restarts=0, health_interval_s=30.0)
        await fleet.start()
        try:
            await fleet.register(0, "http://127.0.0.1:9", serving=True)
            await fleet.register(1, "http://127.0.0.1:10", serving=True)
            busy, silent = AnswerlessAdminForTest(), AnswerlessAdminForTest()
            fleet.admins[0], fleet.admins[1] = busy, silent  # type: ignore[assignment]
            answered_at = {"http://127.0.0.1:9": asyncio.get_running_loop().time()}  # the rollout client's record
            fleet.generation_answered_at = answered_at
            await fleet.check_health()
            assert (busy.probes, silent.probes) == (0, 1)  # the engine generating answers is alive
            assert registry.engines[0].state == EngineState.SERVING
            answered_at["http://127.0.0.1:9"] -= 31.0  # its last answer is older than the interval: probed
            await fleet.check_health()
            assert busy.probes == 1 and registry.engines[0].state == EngineState.FAILED
        finally:
            await fleet.close()

    asyncio.run(scenario())
