"""A stuck engine (a real CPU engine process, SIGSTOPped) during admin calls (issue 24): it is logged within
seconds naming the engine and the call, a call in flight no longer keeps the health check away, the fleet
fails it as dead (the restart path) and the call ends then instead of at its bound; during a weight update
the watchdog names the stopped engine (not the peers that wait on it) and hands it to the fleet."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from hpc_rl.controller import engine_admin
from hpc_rl.controller.engine_admin import BucketUpdate, EngineAdmin, EngineAdminError
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineState, Registry
from hpc_rl.controller.transports.fanout import update_every_engine
from hpc_rl.engines.engine_process import CpuEngineProcess
from tests.unit.test_engine_http_client import sim_fleet

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    process = CpuEngineProcess(REPO / "assets/tiny_qwen3", log_path=tmp_path_factory.mktemp("engine") / "engine.log",
                               api_key="k")
    process.start()
    try:
        process.wait_healthy(120)
        yield process
    finally:
        if process.process.pid:
            os.kill(process.process.pid, signal.SIGCONT)
        process.stop()


def test_a_stopped_engine_is_noticed_failed_and_its_call_ended(engine, monkeypatch, caplog) -> None:
    monkeypatch.setattr(engine_admin, "STUCK_NOTICE_S", 1.0)
    monkeypatch.setattr(engine_admin, "IN_FLIGHT_TRUST_S", 1.0)
    caplog.set_level(logging.WARNING, logger="hpc_rl.controller.engine_admin")

    async def scenario() -> tuple[float, float, str]:
        registry = Registry(trainer_world_size=1, num_engines=1)
        fleet = EngineFleet(registry, None, api_key="k", restart=None, max_restarts=0, health_interval_s=0.5,
                            health_timeout_s=1.0, admin_timeout_s=120.0)
        await fleet.start()
        try:
            await fleet.register(0, engine.url, serving=True)
            os.kill(engine.process.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(EngineAdminError) as ended:  # old: waited the admin timeout (600 s)
                await fleet.admins[0].pause()
            call_ended = time.monotonic() - stopped
            info = registry.engines[0]
            assert info.state == EngineState.FAILED
            failed_event = next(e for e in fleet.events if e["event"] == "failed")
            return call_ended, stopped, f"{failed_event['detail']} | {ended.value}"
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)
            await fleet.close()

    call_ended, _, detail = asyncio.run(scenario())
    assert "health check failed while /pause_generation had no answer for" in detail
    assert "connection closed" in detail or "cannot connect" in detail or "caller" in detail or "failed" in detail
    assert call_ended < 8.0, f"the stuck call ended {call_ended:.1f} s after SIGSTOP"
    notices = [r.getMessage() for r in caplog.records if "has had no answer" in r.getMessage()]
    assert notices and f"engine {engine.url}: /pause_generation has had no answer" in notices[0]
    print(f"stuck engine: call ended {call_ended:.1f} s after SIGSTOP; notice: {notices[0]}")


def test_a_weight_update_names_the_stopped_engine_not_its_peers(engine) -> None:
    async def scenario() -> tuple[list[str], float]:
        async with sim_fleet(2) as (urls, pool):
            admins = [EngineAdmin(url, pool, timeout_s=30.0) for url in urls]
            stuck_admin = EngineAdmin(engine.url, pool, timeout_s=30.0)
            named: list[str] = []
            found = asyncio.Event()

            async def on_stuck(admin: EngineAdmin, why: str) -> None:
                named.append(f"{admin.url}: {why}")
                found.set()

            buckets = [BucketUpdate.of(names=["w"], dtypes=["bfloat16"], shapes=[[4, 4]], group_name="g",
                                       weight_version="1", load_format=None)]
            os.kill(engine.process.pid, signal.SIGSTOP)
            started = time.monotonic()
            update = asyncio.create_task(update_every_engine([*admins, stuck_admin], buckets, on_stuck=on_stuck,
                                                             notice_s=1.0))
            try:
                await asyncio.wait_for(found.wait(), 15)
                seconds = time.monotonic() - started
            finally:
                update.cancel()
                await asyncio.gather(update, return_exceptions=True)
                os.kill(engine.process.pid, signal.SIGCONT)
            return named, seconds

    named, seconds = asyncio.run(scenario())
    assert len(named) == 1 and named[0].startswith(f"{engine.url}: stuck in a weight update: no answer for")
    assert seconds < 6.0
    print(f"weight update: stopped engine named {seconds:.1f} s after SIGSTOP")
