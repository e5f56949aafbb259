"""The controller listens before its rollout stack is built, and `ready()` reports what building it raised."""

from __future__ import annotations

import asyncio

import pytest

from hpc_rl.config import load_config
from hpc_rl.controller.app import Controller
from hpc_rl.data.prompts import DataError
from hpc_rl.protocol.secret import create_secret


def make_controller(tmp_path, in_repo, prompt_data: str) -> Controller:
    config = load_config([in_repo / "configs" / "tiny_cpu.yaml"])
    config.run_dir = str(tmp_path)
    config.rollout.prompt_data = prompt_data
    config.eval.eval_prompt_data = []
    return Controller(config, secret=create_secret(tmp_path / "secret"), router=None, router_url=None)


def test_listens_first_then_reports_a_bad_prompt_file_from_ready(tmp_path, in_repo) -> None:
    async def scenario() -> None:
        controller = make_controller(tmp_path, in_repo, str(tmp_path / "missing.jsonl"))
        try:
            await controller.start()
            assert (tmp_path / "controller.address").read_text().strip().endswith(f":{controller.address[1]}")
            with pytest.raises(DataError, match="missing.jsonl"):
                await controller.ready()
            with pytest.raises(DataError):  # every waiter sees it, not only the first
                await controller.register_engine(0, "http://127.0.0.1:1")
        finally:
            await controller.close()

    asyncio.run(scenario())


def test_ready_builds_the_loop(tmp_path, in_repo) -> None:
    async def scenario() -> None:
        controller = make_controller(tmp_path, in_repo, str(in_repo / "data" / "tiny_copy_train.jsonl"))
        try:
            await controller.start()
            await controller.ready()
            assert controller.loop is not None and controller.loop.num_rollout == 100
        finally:
            await controller.close()

    asyncio.run(scenario())


def test_a_checkpoint_request_before_the_loop_exists_is_kept_for_it(tmp_path, in_repo) -> None:
    """USR2 can come while the rollout stack is still being built (Slurm signals early): the driver hands it
    to the controller (`DriverInterface`), which applies it to the loop once built."""

    async def scenario() -> None:
        controller = make_controller(tmp_path, in_repo, str(in_repo / "data" / "tiny_copy_train.jsonl"))
        try:
            controller.request_checkpoint_and_stop()  # before start(): no loop yet
            assert controller.loop is None and not controller.stopped_for_requeue
            await controller.start()
            await controller.ready()
            assert controller.loop is not None and controller.loop.stop_requested
        finally:
            await controller.close()

    asyncio.run(scenario())


def test_status_components_follow_every_registry_change_and_are_reused_between(tmp_path, in_repo) -> None:
    """status.json is written every 2 s: its components (an entry per engine) are built again only after the registry
    changed, and every change shows (a state, a restart counted in place, the run's end)."""
    from hpc_rl.controller.registry import EngineInfo, EngineState

    controller = make_controller(tmp_path, in_repo, str(tmp_path / "unused.jsonl"))
    registry = controller.registry
    for index in range(3):
        registry.add_engine(EngineInfo(engine_index=index, url=f"http://127.0.0.1:{9000 + index}",
                                       state=EngineState.SERVING))
    first = controller.status()["components"]
    assert controller.status()["components"] is first  # nothing changed: not rebuilt
    registry.set_engine_state(1, EngineState.FAILED, "health check failed")
    engines = controller.status()["components"]["engines"]
    assert engines["1"]["state"] == "failed" and engines["1"]["last_error"] == "health check failed"
    registry.engines[1].restarts += 1  # as the fleet counts a restart, then says so
    registry.changed()
    assert controller.status()["components"]["engines"]["1"]["restarts"] == 1
    controller.outcome = "finished"
    assert {e["state"] for e in controller.status()["components"]["engines"].values()} == {"stopped"}
