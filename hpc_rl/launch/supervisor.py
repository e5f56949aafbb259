"""One attempt of a run: start every process, supervise them, stop them all in order (`Driver`).

Owns: the start order (engines load while the router and the controller come up; then the trainer step,
torchrun with its c10d rendezvous on the first trainer node; colocated, after the engines released the
GPUs), registering engines with the controller, supervising the steps (a dead engine goes to the fleet's
failure path and is restarted; a dead trainer ends the run with its log tail; a dead distillation teacher
fails the run), the engine-restart hook the controller calls (a started engine: stopped and started again,
unless its node is lost; an external one: waited for), and the shutdown order. A trainer-only job (SFT)
starts no engine and no router. Its parts: `servers` (engine, teacher and router processes), `ports`,
`node_watch` (Slurm), `signals`; the controller is reached through its `DriverInterface` only.

Shutdown (success, failure, SIGINT/SIGTERM/scancel alike), every task the driver started is either
awaited or cancelled on purpose, so asyncio never reports an exception "never retrieved":

    signal ──> controller.note_stopping() (a trainer or engine that now disconnects is not a failure)
           ──> cancel the main task ──> shutdown():
                 node watch, health checks and restarts off ──> cancel the controller's run task and wait
                 for it (its rollout aborts, its weight sync unwinds; an error it ends with is logged once)
                 ──> pending engine-failure tasks ──> trainer step ──> engines ──> router
                 ──> Controller.close()
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from hpc_rl.controller.app import Controller
from hpc_rl.controller.stopping import log_task_error, stop_task
from hpc_rl.controller.trainer_channel import TrainerFailed
from hpc_rl.launch.bound_torchrun import STORE_ADDRESS_ENV
from hpc_rl.launch.node_watch import NodeWatch, hostnames_of
from hpc_rl.launch.orphans import end_children, environ_has
from hpc_rl.launch.ports import PortPlan
from hpc_rl.launch.run_plan import RunPlan, load_run_plan
from hpc_rl.launch.servers import Servers
from hpc_rl.launch.signals import SignalStops, StoppedBySignal
from hpc_rl.launch.step_plan import trainer_step
from hpc_rl.launch.steps import StepHandle, StepLauncher
from hpc_rl.launch.trainer_exit import describe_trainer_exit
from hpc_rl.process.child_process import log_tail
from hpc_rl.protocol.secret import Secret, engine_api_key, load_secret, secret_path

log = logging.getLogger("hpc_rl.driver")

EXIT_OK, EXIT_FAILED, EXIT_REQUEUE, EXIT_INTERRUPTED = 0, 1, 3, 130
CONTROLLER_ENV = "HPC_RL_CONTROLLER"
RUN_DIR_ENV = "HPC_RL_RUN_DIR"
TRAINER_NODE_ADDRESSES_ENV = "HPC_RL_TRAINER_NODE_ADDRESSES"  # read by hpc_rl.training.sync_address
EXTERNAL_ENGINE_RETURN_S = 600.0
"""After an external engine failed: how long the run waits for it to answer again (another job restarts it)."""
NODE_REQUEUE_WAIT_S = 120.0
"""After requeuing for a lost node: how long an engine restart waits for Slurm to stop this attempt."""


class Driver:
    """Starts and supervises one attempt of a run (see the module docstring)."""

    def __init__(self, run_dir: str | Path, launcher: StepLauncher, *, local: bool,
                 plan: RunPlan | None = None) -> None:
        self.run_dir = Path(run_dir).resolve()
        plan = plan if plan is not None else load_run_plan(self.run_dir)
        self.config, self.topology = plan.config, plan.topology
        self.launcher = launcher
        self.local = local
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.host = launcher.node_address(0, 0)
        ports = PortPlan.for_job(self.topology, local=local)
        if not local:
            engine_hosts = [launcher.node_address(e.het_group, e.node_index) for e in self.topology.engines]
            ports = ports.avoiding_busy(self.host, engine_hosts)
        self.servers = Servers(self.config, self.topology, launcher, ports, run_dir=self.run_dir, host=self.host,
                               local=local)
        self.nodes = NodeWatch(self.config, self.topology, launcher, run_dir=self.run_dir, local=local,
                               on_loss=self._report_error)
        self.signals = SignalStops(local=local)
        self.trainer_step: StepHandle | None = None
        self.controller: Controller | None = None
        self.failure: Exception | None = None
        """What ended the run, when it failed (run_driver decides on a restart from it)."""
        self.restarts: list[dict[str, Any]] = []
        """Earlier attempts of this job that failed and were restarted (shown in status.json)."""
        self.run_task: asyncio.Task[dict[str, object]] | None = None
        """The controller's run while `run` waits on it; if `run` is interrupted, `shutdown` stops it."""
        self._engine_failures: dict[int, asyncio.Task[None]] = {}

    def _report_error(self, message: str) -> None:
        if self.controller is not None:
            self.controller.report_error(message)

    # -- engines -------------------------------------------------------------------------------------------
    async def start_engine(self, index: int) -> str:
        return await self.servers.start_engine(index)

    async def restart_engine(self, index: int) -> str:
        """The controller's restart hook for engine `index`; returns its URL once it serves again."""
        if self.config.rollout.rollout_external_engine_addrs:  # not ours to start: wait until it answers again
            log.warning("external engine %d failed; waiting up to %.0f s for it to answer again", index,
                        EXTERNAL_ENGINE_RETURN_S)
            return (await self.servers.attach_external_engine(index, EXTERNAL_ENGINE_RETURN_S))[0]
        await self.servers.stop_engine(index)
        nodes = self.nodes.nodes_of_engine(index)
        if nodes:  # a step on a dead node waits in srun until Slurm ends the job: do not start one
            for loss in await self.nodes.check(nodes):
                if self.nodes.requeued:  # Slurm stops this attempt now (SIGTERM); a restart would only race it
                    await asyncio.sleep(NODE_REQUEUE_WAIT_S)
                raise RuntimeError(f"engine {index} is not restarted: {loss.describe(self.nodes.steps_on(loss.node))}")
        return await self.start_engine(index)

    # -- the run -------------------------------------------------------------------------------------------
    async def run(self) -> int:
        secret = load_secret(secret_path(self.run_dir))
        self.servers.engine_key = engine_api_key(secret)
        external = [await self.servers.attach_external_engine(i)  # first: an unreachable one fails the run at once
                    for i in range(len(self.config.rollout.rollout_external_engine_addrs))]
        # Engines need neither the router nor the controller until they register: they load (seconds of
        # imports and the model) while those two come up (issue 11). The tasks run from the first await.
        starts = [asyncio.create_task(self.start_engine(i), name=f"start engine {i}")
                  for i in range(len(self.topology.engines))]
        if self.topology.teacher is not None:
            starts.append(asyncio.create_task(self.servers.start_teacher(), name="start the teacher"))
        try:
            await self._start_control_plane(secret)
            urls = await asyncio.gather(*starts)
            urls = urls[:len(self.topology.engines)]
        except BaseException:  # a failure or a signal: no engine start is left running (shutdown stops the steps)
            for start in starts:
                start.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            raise
        assert self.controller is not None
        sizes = [self.config.cluster.rollout_num_gpus_per_engine] * len(urls)
        if external:
            urls, sizes = [url for url, _ in external], [size for _, size in external]
            log.info("attached %d external engine(s): %s", len(urls), ", ".join(urls))
        await asyncio.gather(*(self.controller.register_engine(i, url, tp_size=size)
                               for i, (url, size) in enumerate(zip(urls, sizes))))  # one batch for the router
        if self.trainer_step is None:
            await self.controller.hand_gpus_to_trainer()  # colocated: the trainer builds on free GPUs (slime's order)
            self._start_trainer()
        assert self.trainer_step is not None
        run = asyncio.create_task(self.controller.run(), name="controller-run")
        self.run_task = self.signals.controller_run = run
        while not run.done():
            await asyncio.wait({run}, timeout=1.0)
            self._supervise(run)
            if self.nodes.failure is not None:
                raise RuntimeError(self.nodes.failure)
        if self.signals.graceful is not None:  # SIGTERM: it ended the run (and read its outcome)
            await self.signals.graceful
            raise StoppedBySignal()
        self.run_task = None  # its outcome is ours now: raised from here, not left to shutdown()
        try:
            run.result()
        except Exception as error:
            if isinstance(error, TrainerFailed) and not getattr(error, "process_alive", False):  # a stopped rank: no exit
                explained = TrainerFailed(await self.explain_trainer_failure(str(error)))
                self.controller.report_error(f"TrainerFailed: {explained}")  # what status.json shows
                raise explained from error
            raise
        waited = time.perf_counter()
        code = await asyncio.to_thread(self.trainer_step.wait, 120.0)
        log.info("the trainer exited %.2f s after the run (code %d)", time.perf_counter() - waited, code)
        if code != 0:
            raise RuntimeError(f"the trainer exited with code {code} after the run; see {self.logs / 'trainer.log'}")
        return EXIT_REQUEUE if self.controller.stopped_for_requeue else EXIT_OK

    async def _start_control_plane(self, secret: Secret) -> None:
        """The router (not in a trainer-only job), then the controller (listening), then (not colocated) the
        trainer step."""
        router = None if self.topology.trainer_only else await self.servers.start_router()
        self.controller = Controller(self.config, secret=secret, router=router,
                                     router_url=router.url if router else None,
                                     restart_engine=self.restart_engine, host=self.host,
                                     port=self.servers.ports.controller, api_key=self.servers.engine_key,
                                     teacher_url=self.servers.teacher_url(), restarts=self.restarts)
        self.signals.attach(self.controller)
        await self.controller.start()
        self.nodes.start()
        if not self.topology.colocate:  # trainer ranks load while the engines do (issue 11); colocated
            self._start_trainer()       # ranks wait: SGLang sizes its KV cache from the GPU memory then free

    def _start_trainer(self) -> None:
        assert self.controller is not None
        rendezvous = f"{self.host}:{self.servers.ports.rendezvous}"
        trainer_env = {**self.config.training.train_env_vars,  # slime's --train-env-vars; hpc_rl's own win
                       CONTROLLER_ENV: f"{self.host}:{self.controller.address[1]}", RUN_DIR_ENV: str(self.run_dir),
                       "OMP_NUM_THREADS": str(self.config.training.num_threads), "HF_HUB_OFFLINE": "1",
                       # trainer rank 0 advertises its node's address for the weight group (training.sync_address)
                       TRAINER_NODE_ADDRESSES_ENV: ",".join(self.launcher.node_address(0, node)
                                                            for node in range(self.config.cluster.actor_num_nodes))}
        if self.local:  # every store of the trainer on loopback (see the README's "What listens")
            trainer_env[STORE_ADDRESS_ENV] = "127.0.0.1"
        self.trainer_step = self.launcher.start(trainer_step(self.config, self.run_dir, rendezvous, env=trainer_env,
                                                             local=self.local))

    async def explain_trainer_failure(self, seen_by_controller: str, wait_s: float = 30.0) -> str:
        """Which rank died and how (torchrun's report, once the step has exited: it stops the other
        ranks first), then what the controller saw."""
        step = self.trainer_step
        if step is None:
            return seen_by_controller
        deadline = time.monotonic() + wait_s
        while step.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        how = describe_trainer_exit(step.poll(), self.logs / "trainer.log", hostnames_of(self.launcher, 0))
        return f"{how}; the controller saw: {seen_by_controller}; log: {self.logs / 'trainer.log'}"

    def _supervise(self, run: asyncio.Task[Any]) -> None:
        assert self.controller is not None and self.trainer_step is not None
        code = self.trainer_step.poll()
        if code is not None and not run.done() and not self.controller.failed:
            self.controller.trainer_exited(
                f"{describe_trainer_exit(code, self.logs / 'trainer.log', hostnames_of(self.launcher, 0))}; "
                f"last lines of {self.logs / 'trainer.log'}:\n{log_tail(self.logs / 'trainer.log')}")
        teacher = self.servers.teacher_step
        if teacher is not None and teacher.poll() is not None and not run.done() and not self.controller.failed:
            raise RuntimeError(f"the distillation teacher exited with code {teacher.poll()}; last lines of "
                               f"{self.logs / 'teacher.log'}:\n{log_tail(self.logs / 'teacher.log')}")
        for index, task in list(self._engine_failures.items()):
            if task.done():
                del self._engine_failures[index]
                log_task_error(task)
        for index, step in list(self.servers.engine_steps.items()):
            if step.poll() is None or index in self._engine_failures:
                continue
            failing = self.controller.engine_exited(index, f"process exited with code {step.poll()}")
            if failing is not None:
                self._engine_failures[index] = asyncio.create_task(failing, name=f"fail engine {index}")

    async def shutdown(self) -> None:
        """Stop every task and process of the run, in the order of the module docstring."""
        if self.controller is not None:
            self.controller.note_stopping()
        await self.nodes.stop()
        if self.controller is not None:
            await self.controller.stop_engine_monitoring()
        if self.run_task is not None:
            await stop_task(self.run_task, "the controller's run", timeout_s=60.0)
        for task in self._engine_failures.values():
            await stop_task(task, task.get_name(), timeout_s=30.0)
        self._engine_failures.clear()
        began = time.perf_counter()
        if self.trainer_step is not None:
            await asyncio.to_thread(self.trainer_step.stop, 15.0)
        await self.servers.stop()
        if self.controller is not None:
            await self.controller.close()
        if self.local:  # what a killed torchrun agent left (its ranks' helpers) was adopted here: end it
            mine = str(self.run_dir)
            ended = await asyncio.to_thread(end_children, keep=lambda pid: not environ_has(pid, RUN_DIR_ENV, mine))
            for pid in ended:
                log.warning("ended pid %d, a process of the run left behind by its parent", pid)
        log.info("every process of the run stopped in %.2f s", time.perf_counter() - began)

