"""The controller process: one asyncio TCP server that ties trainer ranks, engines and the router together.

    driver ──starts──> Controller.start(): TCP server (job secret), engine health task; the rollout stack
       │                 (tokenizer, prompts, scheduler) builds in the background: ready() waits for it
       │                 │
       │   trainer ranks ├─ Hello(trainer, rank, dp_rank) ──> registry; rank 0: ResumeState ──> resume
       │   (torchrun)    ├─ NextCommand ──> TrainCommand | SyncWeightsCommand | SaveCommand | StopCommand
       │                 ├─ WeightPlan (rank 0, during a sync)            (trainer_channel)
       │                 ├─ CommandDone(metrics)
       │                 └─ TrainerHeartbeat (a thread of each rank, own connection): a rank silent during a
       │                    command is named, then fails the run (controller.trainer_command_timeout)
       ├─ engines: driver calls register_engine(i, url) after /health; health task watches them
       │   (engine_fleet); generation goes through sglang-router; admin calls go to each engine
       └─ status: `python -m hpc_rl.status` sends StatusRequest; status.json in the run dir too

    run():  wait_ready (every rank + engine, or a timeout naming who is missing)
            -> restore state from trainer rank 0's checkpoint (resume) -> RunLoop.run (run_loop.py; built
               by rollout_stack.py, which hands each part its own config sections)
            -> StopCommand to every rank

Shutdown order (success, failure, Ctrl-C alike): the loop stops issuing commands -> trainer ranks
get StopCommand (when they are still reachable) -> the driver stops torchrun -> engines -> router ->
Controller.close(): health task, HTTP sessions, then the TCP server. A trainer rank that disconnects
fails the run at once (after a final controller-state save, when a trainer can still save).

One module (~400 lines) on purpose: it is the wiring of the parts above (each its own module: registry,
trainer_channel, engine_fleet, engine_membership, run_loop, rollout_stack), their start, shutdown order and the
status they report together; what remains here is the order, which reads best in one place.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

import orjson

from hpc_rl.config.schema import RunConfig
from hpc_rl.controller.address import CONTROLLER_ADDRESS_FILE, write_controller_address
from hpc_rl.controller.engine_fleet import EngineFleet, RestartFn, RouterMembership
from hpc_rl.controller.engine_membership import EngineMembership
from hpc_rl.controller.registry import Registry, TrainerInfo
from hpc_rl.controller.rollout_stack import build_rollout_stack
from hpc_rl.controller.run_loop import RunLoop
from hpc_rl.controller.driver_interface import DriverInterface
from hpc_rl.controller.stopping import stop_task
from hpc_rl.controller.trainer_channel import TrainerChannel, TrainerFailed
from hpc_rl.engines.gpu_step import PLACEMENT_DIR, reported_devices
from hpc_rl.protocol import Connection, Envelope, Secret, Server
from hpc_rl.protocol.errors import ProtocolError
from hpc_rl.protocol.frame_signer import FrameSigner
from hpc_rl.protocol.messages import (Ack, CommandDone, EngineJoin, EngineJoined, EngineLeave, EngineLeft, Hello,
                                      Message, NextCommand, Ping, Pong, ResumeState,
                                      StatusReply, StatusRequest, TrainerHeartbeat, WeightGroupJoinCheck,
                                      WeightGroupJoinVerdict, WeightPlan)
from hpc_rl.rewards.pool import RewardPool
from hpc_rl.rewards.reward_thread import RewardThread
from hpc_rl.rollout import EngineClient
from hpc_rl.rollout.teacher import TeacherLogprobs
from hpc_rl.telemetry.run_files import describe_write_error, write_text_atomically

log = logging.getLogger(__name__)

__all__ = ["CONTROLLER_ADDRESS_FILE", "Controller"]

GC_FIRST_GENERATION = 50_000
"""Allocations between the controller process's youngest-generation collections (Python's default: 700).
Every /generate answer allocates thousands of containers; with the default, cyclic GC took 0.97 of the
controller's ~5.5 CPU s in a run of 8,192 samples at 256 simulated engines, 0.18 s with this
(benchmarks/bench_scale.py --engines 256 --modes sync: 0.68 -> 0.52 CPU s per 1,000 samples)."""


class Controller(DriverInterface):
    """One run's controller (see the module docstring for the message flow and shutdown order). It is the
    composition root: it holds the whole resolved config and hands the parts their sections (the loop's
    parts through `rollout_stack`). What the driver may ask of it besides its lifecycle: `DriverInterface`."""

    def __init__(self, config: RunConfig, *, secret: Secret, router: RouterMembership | None,
                 router_url: str | None, restart_engine: RestartFn | None = None,
                 host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 teacher_url: str | None = None, restarts: list[dict[str, Any]] | None = None) -> None:
        self.config = config
        self.teacher_url = teacher_url
        """On-policy distillation: the teacher engine the driver started (None: none, or slime's --rm-url)."""
        self.run_dir = Path(config.run_dir)
        self.secret = secret
        self.host, self.port = host, port
        self.registry = Registry(trainer_world_size=config.cluster.trainer_world_size,  # external ones, else the job's
                                 num_engines=len(config.rollout.rollout_external_engine_addrs) or config.cluster.num_engines)
        self.channel = TrainerChannel.with_timeout(config.cluster.trainer_world_size,
                                                   config.controller.trainer_command_timeout)
        self.fleet = EngineFleet(self.registry, router, api_key=api_key, restart=restart_engine,
                                 max_restarts=config.controller.max_engine_restarts,
                                 health_interval_s=config.controller.engine_health_interval,
                                 health_timeout_s=config.controller.engine_health_timeout,
                                 health_first_wait_s=config.controller.engine_health_first_wait,
                                 admin_timeout_s=config.controller.engine_admin_timeout,
                                 devices_of=lambda index: reported_devices(self.run_dir, index))
        self.router_url = router_url
        self.membership = EngineMembership(
            self.registry, self.fleet, weight_version=lambda: self.loop.weights.version if self.loop else 0,
            initial_weights=lambda: self.loop is None or (self.loop.weights.version == 0 and not self.loop.weights.pushes))
        """Engines of engine jobs joining and leaving mid-run (engine_membership; docs/engine-jobs.md)."""
        signer_min_bytes = config.controller.frame_signer_min_bytes
        self.frame_signer = FrameSigner(secret, min_frame_bytes=signer_min_bytes) if signer_min_bytes is not None else None
        """Computes the MACs of the train batches' frames in a process of its own (started at the first one)."""
        self.server: Server | None = None
        self.loop: RunLoop | None = None
        self.client: EngineClient | None = None
        self.reward_pool: RewardPool | None = None
        """Worker processes for rule-based rewards (`rollout.reward_workers`), once the stack is built."""
        self.teacher: TeacherLogprobs | None = None
        self.reward_thread: RewardThread | None = None
        """The thread custom reward functions run on, once the stack is built."""
        self.stopping = False
        self.started_at = time.time()
        self.last_error = ""
        self.outcome = "running"
        """'running' until the run ends: then 'finished', 'failed' or 'stopped' (what status.json keeps)."""
        self.restarts: list[dict[str, Any]] = restarts if restarts is not None else []
        """Earlier attempts of this job that failed and were restarted by the driver (max_restarts)."""
        self._stop_for_requeue = False
        """USR2 came (`request_checkpoint_and_stop`): the loop, once built, saves at a boundary and stops."""
        self._status_task: asyncio.Task[None] | None = None
        self._status_write_failing = False
        self._components_cache: tuple[tuple[int, str], dict[str, dict[str, Any]]] | None = None
        self._rollout_stack: asyncio.Task[None] | None = None
        self.resume_state: ResumeState | None = None
        """What trainer rank 0's checkpoint says about resuming (its ResumeState, after the handshake)."""
        self._resume_received = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen at once; build the rollout stack (tokenizer, prompts: seconds) in the background, so
        that it overlaps the engines' and trainers' start-up. `ready()` waits for it."""
        gc.set_threshold(GC_FIRST_GENERATION, *gc.get_threshold()[1:])
        self.server = Server(self.secret, self._handle, on_hello=self._on_hello, on_close=self._on_close,
                             signer=self.frame_signer)
        await self.server.start(self.host, self.port)
        await self.fleet.start()
        self._rollout_stack = asyncio.create_task(self._start_rollout_stack(), name="build the rollout stack")
        self._status_task = asyncio.create_task(self._write_status_forever())
        write_controller_address(self.run_dir, self.host, self.server.address[1])
        log.info("controller listening on %s:%d", *self.server.address)

    async def ready(self) -> None:
        """The rollout stack is built (raises what building it raised: a bad prompt file, say)."""
        assert self._rollout_stack is not None, "start() first"
        await asyncio.shield(self._rollout_stack)

    async def _start_rollout_stack(self) -> None:
        stack = await asyncio.to_thread(build_rollout_stack, self.config, registry=self.registry,
                                        channel=self.channel, fleet=self.fleet, router_url=self.router_url,
                                        teacher_url=self.teacher_url)
        self.client, self.loop = stack.client, stack.loop
        self.loop.stop_requested |= self._stop_for_requeue  # a USR2 that came while the stack was built
        self.reward_pool, self.teacher = stack.reward_pool, stack.teacher
        self.reward_thread = stack.reward_thread
        await self.client.start()
        if self.reward_pool is not None:
            await self.reward_pool.start()
        self.fleet.on_serving = self.client.wake_waiters
        self.membership.in_flight_on = self.client.in_flight_on
        self.membership.first_send_watch = self.client.first_send_watch
        self.membership.watch_early_joiners()
        self.fleet.on_router_lost = self._router_lost

    def _router_lost(self) -> None:
        """The router exited (the fleet reported it): single requests go to the engines directly too."""
        if self.client is not None:
            self.client.router_url = None

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        return self.server.address

    async def register_engine(self, engine_index: int, url: str, *, tp_size: int = 1) -> None:
        """The driver started engine `engine_index` and it answers /health at `url`."""
        await self.ready()
        await self.fleet.register(engine_index, url, tp_size=tp_size, serving=True)
        log.info("engine %d registered at %s", engine_index, url)

    async def hand_gpus_to_trainer(self) -> None:
        """Colocated, before the trainer starts: the engines release all their memory (see
        `WeightUpdates.hand_gpus_to_trainer`); nothing in decoupled runs."""
        await self.ready()
        assert self.loop is not None
        await self.loop.weights.hand_gpus_to_trainer()

    async def run(self) -> dict[str, Any]:
        """Wait for everyone, resume if a checkpoint says so, run every rollout, stop the trainers."""
        await self.ready()
        assert self.loop is not None
        ready = asyncio.create_task(self.registry.wait_ready(self.config.controller.registration_timeout),
                                    name="wait for registrations")
        try:
            while not ready.done():  # a trainer step that dies before registering must not leave us waiting
                await asyncio.wait({ready}, timeout=1.0)
                if self.channel.failure is not None and not ready.done():
                    raise self.channel.failure
        finally:
            if not ready.done():  # failed or cancelled while waiting (a done `ready` is read just below)
                await stop_task(ready, "waiting for registrations")
        ready.result()
        log.info("all components registered: %d trainer rank(s), %d engine(s)", len(self.registry.trainers),
                 len(self.registry.engines))
        resume = await self._wait_resume_state()
        if not (resume and resume.get("controller_state")):  # a fresh start (at checkpoint.start_rollout_id): the
            self.loop.recorder.forget_from(self.loop.next_rollout_id)  # records it redoes move to rollouts.redone
        if resume and resume.get("controller_state"):
            self.loop.restore(resume["controller_state"])
            next_id = self.loop.next_rollout_id
            log.info("resuming at rollout %d (weight version %d)", next_id, self.loop.weights.version)
            if next_id >= self.loop.num_rollout:
                print(f"hpc_rl: nothing to do: the checkpoint in {self.config.checkpoint.load} is already at "
                      f"rollout {next_id} of {self.loop.num_rollout} (this run finished before); raise "
                      "num_rollout to train further, or use a new --run-dir for a new run", flush=True)
        try:
            metrics = await self.loop.run(resumed=bool(resume))
        except Exception as error:  # (a cancellation is a stop, not an error of the run)
            self.last_error = f"{type(error).__name__}: {error}"
            self.outcome = "failed"
            raise
        self.stopping = True
        await self.loop.trainers.stop("run complete")
        self.outcome = "stopped" if self.loop.stopped_for_requeue else "finished"  # a USR2 stop is not the end
        return metrics

    async def close(self) -> None:
        self.stopping = True
        if self.outcome == "running":  # closed without an outcome: interrupted or failed before the loop
            self.outcome = "failed" if self.last_error or self.channel.failure else "stopped"
        for task in (self._status_task, self._rollout_stack):
            if task is not None and not task.done():
                task.cancel()
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        self.write_status()  # the final one: the run has ended, nothing is serving any more
        (self.run_dir / CONTROLLER_ADDRESS_FILE).unlink(missing_ok=True)
        await self.membership.close()
        await self.fleet.close()
        if self.client is not None:
            await self.client.close()
        if self.reward_pool is not None:
            self.reward_pool.close()
        if self.teacher is not None:
            self.teacher.close()
        if self.reward_thread is not None:
            self.reward_thread.close()
        if self.server is not None:
            await self.server.close()
        if self.frame_signer is not None:
            await self.frame_signer.close()
        if self.loop is not None:
            self.loop.recorder.close()

    # -- protocol ------------------------------------------------------------------------------------------
    async def _on_hello(self, conn: Connection, hello: Hello) -> dict[str, Any] | None:
        if hello.role == "trainer":
            try:
                self.registry.add_trainer(TrainerInfo(rank=hello.rank, world_size=hello.world_size, host=hello.host,
                                                      pid=hello.pid, info=dict(hello.info)))
            except ValueError as error:
                raise ProtocolError(str(error)) from None
            if len(self.registry.trainers) == self.registry.trainer_world_size:
                self._write_trainer_devices()
            self.channel.heard_from(hello.rank)
            return {"run_dir": str(self.run_dir), "heartbeat_interval_s": self.channel.heartbeat_interval_s}
        return {"run_dir": str(self.run_dir)}

    def _write_trainer_devices(self) -> None:
        """`placement/trainers.json`: each rank's GPU as it reported it (engines report theirs beside it)."""
        devices = {str(rank): t.info.get("device") for rank, t in sorted(self.registry.trainers.items())}
        path = self.run_dir / PLACEMENT_DIR / "trainers.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, json.dumps(devices, indent=1) + "\n")
        except OSError as error:
            log.warning("trainer placement not written: %s", describe_write_error(error, path))

    async def _on_close(self, conn: Connection, error: BaseException | None) -> None:
        hello = conn.hello
        if hello is None or hello.role != "trainer":
            return
        self.registry.remove_trainer(hello.rank)
        if not self.stopping:
            self.channel.fail(TrainerFailed(f"trainer rank {hello.rank} (pid {hello.pid} on {hello.host}) "
                                            f"disconnected: {error or 'connection closed'}"))

    async def _handle(self, conn: Connection, envelope: Envelope) -> Message | None:
        message = envelope.message
        if isinstance(message, TrainerHeartbeat):
            self.channel.heard_from(message.rank)
            return Ack()
        if isinstance(message, NextCommand):
            return await self.channel.next_command(message.rank)
        if isinstance(message, CommandDone):
            self.channel.on_done(message)
            return Ack()
        if isinstance(message, WeightPlan):
            self.channel.on_weight_plan(message)
            return Ack()
        if isinstance(message, WeightGroupJoinCheck):
            return WeightGroupJoinVerdict(give_up=self.channel.join_verdict(message.seq))
        if isinstance(message, StatusRequest):
            return StatusReply(status=self.status())
        if isinstance(message, Ping):
            return Pong(payload=message.payload)
        if isinstance(message, ResumeState):
            return self._on_resume_state(conn, message)
        if isinstance(message, EngineJoin):
            index = await self.membership.join(url=message.url, tp_size=message.tp_size, job_id=message.job_id,
                                               name=message.name)
            return EngineJoined(engine_index=index, weight_version=self.membership.weight_version())
        if isinstance(message, EngineLeave):
            requeued, drain_s = await self.membership.leave(message.engine_index, message.reason or "engine job ends")
            return EngineLeft(requeued=requeued, drain_s=drain_s)
        raise ProtocolError(f"unexpected message {message.TYPE!r} from {conn.peer}")

    def _on_resume_state(self, conn: Connection, message: ResumeState) -> Ack:
        hello = conn.hello
        if hello is None or hello.role != "trainer" or hello.rank != 0 or message.rank != 0:
            raise ProtocolError("resume state comes from trainer rank 0 only")
        if self.resume_state is not None:
            raise ProtocolError("resume state was already sent")
        self.resume_state = message
        self._resume_received.set()
        return Ack()

    async def _wait_resume_state(self) -> dict[str, Any] | None:
        """Trainer rank 0's resume state, when its Hello announced one (it follows the handshake)."""
        trainer = self.registry.trainers.get(0)
        if trainer is None or not trainer.info.get("resume_follows"):
            return None
        deadline = time.monotonic() + self.config.controller.registration_timeout
        while not self._resume_received.is_set():
            if self.channel.failure is not None:
                raise self.channel.failure
            if time.monotonic() > deadline:
                raise RuntimeError("trainer rank 0 announced resume state but did not send it within "
                                   f"{self.config.controller.registration_timeout} s")
            try:
                await asyncio.wait_for(self._resume_received.wait(), 1.0)
            except TimeoutError:
                pass
        assert self.resume_state is not None
        return {"rollout_id": self.resume_state.rollout_id, "controller_state": self.resume_state.controller_state}

    # -- status --------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """JSON-able (str keys only: it travels in a StatusReply and lands in status.json)."""
        loop = self.loop
        last = loop.recorder.last if loop else {}
        return {
            "run_dir": str(self.run_dir),
            "state": self.outcome,
            "controller": {"address": f"{self.host}:{self.address[1] if self.server else 0}",
                           "uptime_s": round(time.time() - self.started_at, 1)},
            "rollout_id": loop.next_rollout_id if loop else 0,
            "num_rollout": loop.num_rollout if loop else 0,
            "weight_version": loop.weights.version if loop else 0,
            "buffer_size": loop.rollouts.buffer_size if loop else 0,
            "last_rollout_seconds": last.get("time/step"),
            "reward_mean": last.get("rollout/reward_mean"),
            "samples_per_second": (self.config.rollout.rollout_batch_size * self.config.rollout.n_samples_per_prompt
                                   / last["time/step"]) if last.get("time/step") else None,
            "components": self._components(),
            "engine_events": self.fleet.events[-20:],
            "engine_jobs": self.membership.summary(),
            "retained": (loop.rollouts.retention.summary() if loop and loop.rollouts.retention is not None
                         and loop.rollouts.retention.enabled else None),
            "warnings": self.channel.liveness_warnings() + (loop.recorder.warnings if loop else []),
            "last_error": self.last_error or (str(self.channel.failure) if self.channel.failure else ""),
            "restarts": self.restarts,
            "updated_at": time.time(),
        }

    def _components(self) -> dict[str, dict[str, Any]]:
        """Trainer ranks and engines by str(rank/index); once the run ended, engines are 'stopped'. Built again
        only after the registry changed (status.json is written every 2 s: at 1,024 engines the rebuild was
        ~2 ms of the loop each time)."""
        key = (self.registry.changes, self.outcome)
        cached = self._components_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        components = self._build_components()
        self._components_cache = (key, components)
        return components

    def _build_components(self) -> dict[str, dict[str, Any]]:
        snapshot = self.registry.snapshot()
        components = {kind: {str(key): dict(value) for key, value in members.items()}
                      for kind, members in snapshot.items()}
        if self.outcome != "running":
            for engine in components.get("engines", {}).values():
                engine["state"] = "stopped"
        return components

    def write_status(self) -> None:
        """status.json, whole or not at all; a failure (a full disk) is warned about once, not every 2 s."""
        path = self.run_dir / "status.json"
        try:
            # orjson: the stdlib encoder took ~40 ms per write at 1,024 engines (1.1 of the controller's
            # ~7 CPU s in a profiled bench_scale run at N=1,024), every 2 s.
            text = orjson.dumps(self.status(), default=str,
                                option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
            write_text_atomically(path, text)
        except OSError as error:
            if not self._status_write_failing:
                log.warning("status.json not updated: %s (retrying every 2 s; said once)",
                            describe_write_error(error, path))
            self._status_write_failing = True
            return
        if self._status_write_failing:
            log.warning("status.json is written again")
        self._status_write_failing = False

    async def _write_status_forever(self) -> None:
        while True:
            self.write_status()
            await asyncio.sleep(2.0)
