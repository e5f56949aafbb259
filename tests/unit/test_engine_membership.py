"""Engines joining and leaving a run (controller.engine_membership, engine_fleet.leave) and the engine agent
(launch.engine_agent) against a real authenticated server: indices, states, router membership, the drain of a
leaving engine's requests, and an agent that follows a new controller and gives up without one."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from hpc_rl.controller.address import write_controller_address
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.engine_membership import EngineMembership
from hpc_rl.controller.registry import EngineState, Registry
from hpc_rl.launch.engine_agent import EngineAgent
from hpc_rl.launch.engine_job import engines_per_node, render_engine_job_script
from hpc_rl.protocol import Server
from hpc_rl.protocol.messages import EngineJoin, EngineJoined, EngineLeave, EngineLeft, Ping, Pong
from hpc_rl.protocol.secret import create_secret, secret_path


class FakeRouter:
    """Records membership calls (stands in for sglang-router)."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    def add_workers(self, urls: list[str]) -> None:
        self.urls += urls

    def remove_worker(self, url: str) -> None:
        self.urls.remove(url)


class FakeAdmin:
    """An engine's admin calls: an abort 'returns' every request the fake client holds on it."""

    def __init__(self, url: str, in_flight: dict[str, int]) -> None:
        self.url, self.in_flight = url, in_flight
        self.calls_in_flight = 0
        self.aborts = 0

    async def abort_requests(self) -> None:
        self.aborts += 1
        await asyncio.sleep(0.01)
        self.in_flight[self.url] = 0

    def known_alive(self, seconds: float, now: float | None = None) -> bool:
        return True


async def _membership(own_engines: int, *, initial: bool) -> tuple[EngineMembership, EngineFleet, FakeRouter,
                                                                   dict[str, int], list[int]]:
    registry = Registry(trainer_world_size=1, num_engines=own_engines)
    router = FakeRouter()
    fleet = EngineFleet(registry, router, api_key=None, restart=None, max_restarts=0, health_interval_s=3600)
    await fleet.start()
    for i in range(own_engines):
        await fleet.register(i, f"http://own-{i}", serving=True)
    in_flight: dict[str, int] = {}
    failed: list[int] = []
    fleet.on_failed = failed.append
    membership = EngineMembership(registry, fleet, weight_version=lambda: 3, initial_weights=lambda: initial,
                                  in_flight_on=lambda url: in_flight.get(url, 0), first_send_watch={})
    return membership, fleet, router, in_flight, failed


def test_a_joiner_gets_the_next_index_and_waits_for_weights_then_leaves_drained() -> None:
    async def scenario() -> None:
        membership, fleet, router, in_flight, failed = await _membership(2, initial=False)
        index = await membership.join(url="http://job-a", tp_size=1, job_id="17", name="a")
        assert index == 2 and fleet.registry.engines[2].state == EngineState.STARTING
        assert fleet.engine_waiting.is_set() and "http://job-a" not in router.urls  # no request before weights
        assert await membership.join(url="http://job-a", tp_size=1, job_id="17", name="a") == 2  # a re-sent join
        await fleet.mark_serving([2])  # what the loop's sync does once the engine holds the current version
        assert "http://job-a" in router.urls and "http://job-a" in fleet.registry.engine_urls()
        assert membership.records[2]["first_request_s"] is None
        membership.first_send_watch.pop("http://job-a")()  # what the rollout client does at its first request there
        in_flight["http://job-a"] = 5
        assert membership.records[2]["first_request_s"] >= 0
        admin = FakeAdmin("http://job-a", in_flight)
        fleet.admins[2] = admin  # type: ignore[assignment]
        requeued, drain_s = await membership.leave(2, "job 17 ends")
        assert (requeued, admin.aborts) == (5, 1) and in_flight["http://job-a"] == 0 and drain_s > 0
        engine = fleet.registry.engines[2]
        assert engine.state == EngineState.LEFT and "http://job-a" not in router.urls
        assert "http://job-a" not in fleet.registry.engine_urls() and engine not in fleet.registry.live_engines()
        assert failed == [2]  # the weight transport forgets it (a group it was in is rebuilt)
        assert fleet.registry.missing() == ["trainer rank 0"]  # joiners are never missing (no trainer here)
        await fleet.fail_engine(2, "its process stopped")  # the job stops it after the leave: not a failure
        assert engine.state == EngineState.LEFT and fleet.events[-1]["event"] == "left"
        summary = membership.summary()["17"]
        assert summary["engines"]["2"]["state"] == "left" and summary["engines"]["2"]["requeued"] == 5
        await membership.close()
        await fleet.close()

    asyncio.run(scenario())


def test_a_joiner_with_the_weights_serves_direct_requests_before_the_router_lists_it() -> None:
    async def scenario() -> None:
        membership, fleet, router, in_flight, _ = await _membership(1, initial=False)
        listed = asyncio.Event()
        slow_add = router.add_workers

        def add_when_allowed(urls: list[str]) -> None:  # sglang-router waits until it lists them: seconds
            while not listed.is_set():
                time.sleep(0.01)
            slow_add(urls)

        router.add_workers = add_when_allowed  # type: ignore[method-assign]
        index = await membership.join(url="http://c0", tp_size=1, job_id="9", name="c0")
        await fleet.serve_before_router([index])
        assert "http://c0" in fleet.registry.engine_urls() and "http://c0" not in router.urls
        fleet.admins[index] = FakeAdmin("http://c0", in_flight)  # type: ignore[assignment]
        await membership.leave(index, "gone before the router listed it")
        listed.set()
        while fleet._restarts:  # the background registration ends ...
            await asyncio.sleep(0.01)
        assert "http://c0" not in router.urls  # ... and takes back what it added for an engine that left
        await membership.close()
        await fleet.close()

    asyncio.run(scenario())


def test_a_joiner_before_any_push_serves_at_once_and_indices_never_repeat() -> None:
    async def scenario() -> None:
        membership, fleet, router, in_flight, _ = await _membership(1, initial=True)
        first = await membership.join(url="http://b0", tp_size=2, job_id="20", name="b0")
        assert fleet.registry.engines[first].state == EngineState.SERVING and "http://b0" in router.urls
        fleet.admins[first] = FakeAdmin("http://b0", in_flight)  # type: ignore[assignment]
        await membership.leave(first, "done")
        again = await membership.join(url="http://b0", tp_size=2, job_id="21", name="b0 again")
        assert again == first + 1  # a left index is not reused: logs and status keep telling them apart
        with pytest.raises(ValueError, match="not in this run"):
            await membership.leave(99, "unknown")
        await membership.close()
        await fleet.close()

    asyncio.run(scenario())


def test_a_failed_engine_job_engine_is_not_restarted_by_the_controller() -> None:
    """Its job owns the process (the driver's restart knows only the run's own engines: it raised IndexError)."""
    async def scenario() -> None:
        registry = Registry(trainer_world_size=1, num_engines=1)
        restarts: list[int] = []

        async def restart(index: int) -> str:
            restarts.append(index)
            return f"http://own-{index}"

        fleet = EngineFleet(registry, FakeRouter(), api_key=None, restart=restart, max_restarts=3,
                            health_interval_s=3600)
        await fleet.start()
        await fleet.register(0, "http://own-0", serving=True)
        membership = EngineMembership(registry, fleet, weight_version=lambda: 3, initial_weights=lambda: True)
        joined = await membership.join(url="http://b0", tp_size=1, job_id="20", name="b0")
        await fleet.fail_engine(joined, "weight sync broke")
        await fleet.fail_engine(0, "health check failed")
        await asyncio.sleep(0.05)
        assert registry.engines[joined].state == EngineState.FAILED and registry.engines[joined].restarts == 0
        assert restarts == [0]  # the run's own engine is restarted, the engine job's is not
        await membership.close()
        await fleet.close()

    asyncio.run(scenario())


def test_a_joiner_before_the_rollout_client_exists_is_timed_from_its_join() -> None:
    """Engine jobs re-joining a restarted controller come before its rollout client: their first request is
    still measured (status.json's first_request_s)."""
    async def scenario() -> None:
        membership, fleet, _, _, _ = await _membership(1, initial=True)
        membership.first_send_watch = None  # the stack is not built yet
        index = await membership.join(url="http://b0", tp_size=1, job_id="20", name="b0")
        watch: dict = {}
        membership.first_send_watch = watch
        membership.watch_early_joiners()
        watch.pop("http://b0")()  # the client's first send to it
        assert membership.records[index]["first_request_s"] is not None
        await fleet.close()

    asyncio.run(scenario())


def test_the_engine_job_script_and_its_size(tiny_config) -> None:
    tiny_config.cluster.rollout_num_gpus_per_engine = 2
    tiny_config.cluster.num_gpus_per_node = 8
    assert engines_per_node(tiny_config, 16) == (2, 4)
    with pytest.raises(ValueError, match="multiple of the run's engine TP size"):
        engines_per_node(tiny_config, 3)
    tiny_config.slurm.partition, tiny_config.slurm.rollout_partition = "train", "infer"
    script = render_engine_job_script(tiny_config, Path("/runs/r"), rollout_num_gpus=16, python="python3")
    assert "#SBATCH --partition=infer\n" in script and "#SBATCH --nodes=2\n" in script
    assert "#SBATCH --signal=B:USR1@" in script
    assert script.rstrip().endswith("python3 -m hpc_rl.launch.engine_job /runs/r --engines-per-node 4")


@pytest.fixture
def tiny_config():
    from hpc_rl.config import load_config

    return load_config([str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")], [])


class ControllerStandIn:
    """A real authenticated Server that answers the agent's messages as the controller does (for the agent only)."""

    def __init__(self, run_dir: Path, first_index: int) -> None:
        self.run_dir, self.next_index = run_dir, first_index
        self.joins: list[EngineJoin] = []
        self.leaves: list[EngineLeave] = []
        self.server: Server | None = None

    async def handle(self, conn, envelope):  # type: ignore[no-untyped-def]
        message = envelope.message
        if isinstance(message, EngineJoin):
            self.joins.append(message)
            self.next_index += 1
            return EngineJoined(engine_index=self.next_index - 1, weight_version=0)
        if isinstance(message, EngineLeave):
            self.leaves.append(message)
            return EngineLeft(requeued=4, drain_s=0.25)
        if isinstance(message, Ping):
            return Pong()
        return None

    async def start(self, secret) -> None:  # type: ignore[no-untyped-def]
        self.server = Server(secret, self.handle)
        await self.server.start("127.0.0.1", 0)
        write_controller_address(self.run_dir, "127.0.0.1", self.server.port)


def test_the_agent_joins_follows_a_new_controller_and_leaves(tmp_path: Path) -> None:
    secret = create_secret(secret_path(tmp_path))

    async def scenario() -> None:
        first = ControllerStandIn(tmp_path, 5)
        await first.start(secret)
        agent = EngineAgent(tmp_path, url="http://e:1", tp_size=2, job_id="42", name="e", cleanup_timeout_s=30,
                            poll_s=0.05)
        result: list = []
        thread = threading.Thread(target=lambda: result.append(agent.run()))
        thread.start()
        while not first.joins:
            await asyncio.sleep(0.02)
        assert (first.joins[0].url, first.joins[0].tp_size, first.joins[0].job_id) == ("http://e:1", 2, "42")
        await first.server.close()  # the trainer's job (and its controller) ended ...
        second = ControllerStandIn(tmp_path, 9)
        await second.start(secret)  # ... and a resubmitted one started a new controller
        while not second.joins:
            await asyncio.sleep(0.02)
        agent.stop.set()
        while thread.is_alive():
            await asyncio.sleep(0.02)
        outcome = result[0]
        assert [index for _, index in outcome.joins] == [5, 9]
        assert second.leaves[0].engine_index == 9 and outcome.left.requeued == 4
        await second.server.close()

    asyncio.run(scenario())


def test_the_agent_gives_up_without_a_controller(tmp_path: Path) -> None:
    create_secret(secret_path(tmp_path))
    agent = EngineAgent(tmp_path, url="http://e:1", tp_size=1, job_id="1", name="e", cleanup_timeout_s=0.3,
                        poll_s=0.05)
    start = time.monotonic()
    outcome = agent.run()
    assert "no controller for 0.3 s" in outcome.reason and outcome.joins == [] and outcome.left is None
    assert time.monotonic() - start < 30  # it gives up (after 0.3 s), it does not wait on


def test_status_lists_engine_jobs_with_their_ids_and_engines(tmp_path: Path, monkeypatch) -> None:
    """`python -m hpc_rl.status`: engine jobs recorded at submit and those the controller knows, with Slurm's state
    (asked only for Slurm ids; a fake answer here) and each engine's."""
    from hpc_rl import status as status_cli
    from hpc_rl.launch import slurm_status
    from hpc_rl.launch.engine_job import record_engine_job

    record_engine_job(tmp_path, "301", rollout_num_gpus=2)
    asked: list[str] = []
    monkeypatch.setattr(slurm_status, "component_states", lambda job_id: asked.append(job_id) or [
        slurm_status.ComponentState(job_id=job_id, state="CANCELLED", nodes="node3", elapsed="00:01:00")])
    live = {"301": {"engines": {"4": {"state": "left"}}}, "local-77": {"engines": {"5": {"state": "serving"}}}}
    listed = status_cli.engine_job_list(tmp_path, live)
    text = status_cli.format_status({"source": "test", "engine_job_list": listed})
    assert "engine job 301: slurm CANCELLED; engine 4 left" in text
    assert "engine job local-77: slurm -; engine 5 serving" in text and asked == ["301"]


def test_submit_engines_for_a_directory_that_is_no_run(tmp_path: Path, capsys) -> None:
    from hpc_rl.submit import main

    assert main(["--engines-for", str(tmp_path), "--executor", "local"]) == 2
    assert "no config.resolved.yaml and secret there" in capsys.readouterr().err
