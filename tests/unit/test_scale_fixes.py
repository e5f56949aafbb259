"""Bottlenecks bench_scale.py found at 256-1,024 simulated engines, each pinned by a test."""

from __future__ import annotations

import asyncio

from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry


def test_engine_urls_are_rebuilt_only_after_a_change(monkeypatch) -> None:
    """The rollout client asks for the serving URLs on every request: no O(N) rebuild per call."""
    registry = Registry(trainer_world_size=1, num_engines=3)
    for index in range(3):
        registry.add_engine(EngineInfo(engine_index=index, url=f"http://e{index}", state=EngineState.SERVING))
    builds = []
    original = registry.serving_engines
    monkeypatch.setattr(registry, "serving_engines", lambda: builds.append(1) or original())
    assert [registry.engine_urls() for _ in range(5)] == [["http://e0", "http://e1", "http://e2"]] * 5
    assert len(builds) == 1
    registry.set_engine_state(1, EngineState.FAILED, "health check failed")
    assert registry.engine_urls() == ["http://e0", "http://e2"]
    registry.add_engine(EngineInfo(engine_index=1, url="http://e1b", state=EngineState.SERVING))
    assert registry.engine_urls() == ["http://e0", "http://e1b", "http://e2"]
    urls = registry.engine_urls()
    urls.clear()  # a caller's copy: the registry's view is not changed through it
    assert registry.engine_urls() == ["http://e0", "http://e1b", "http://e2"]


def test_fleet_session_keeps_a_connection_per_engine() -> None:
    """aiohttp's default cap of 100 connections made every admin call beyond engine 100 reconnect."""

    async def scenario() -> None:
        fleet = EngineFleet(Registry(trainer_world_size=1, num_engines=1), None, api_key=None, restart=None,
                            max_restarts=0, health_interval_s=3600)
        await fleet.start()
        try:
            assert fleet.session is not None and fleet.session.connector is not None
            assert fleet.session.connector.limit == 0
        finally:
            await fleet.close()

    asyncio.run(scenario())
