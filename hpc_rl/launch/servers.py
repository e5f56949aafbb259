"""Starting the run's servers: the engine steps, the distillation teacher, sglang-router, external engines.

Owns: each engine's step (CPU engine or SGLang; a multi-node engine's node-ranks) with the job's engine key in
its environment (SGLang: in a 0600 `--config` file, its log created 0600), waiting until it answers /health,
and starting it again on a free port when its own was taken (`ENGINE_BIND_RETRIES`); the teacher engine of
on-policy distillation; the router on loopback, answering with the job's key, restarted on free ports when
its ports are taken; attaching to engines another job serves (rollout.rollout_external_engine_addrs: /health,
then /server_info with the key). Not here: when to start or restart them (`supervisor`), the ports' plan
(`ports`), what each step's command is (`step_plan`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from hpc_rl.config import RunConfig
from hpc_rl.config.sglang_options import engine_kind, external_engine_url
from hpc_rl.engines import API_KEY_ENV
from hpc_rl.engines.gpu_step import engine_report_path
from hpc_rl.engines.router import RouterProcess
from hpc_rl.engines.sglang_launch import SGLANG_ON_CPU_ENV, build_sglang_env, write_api_key_file
from hpc_rl.launch.ports import PortPlan, bind_failed, log_since
from hpc_rl.launch.step_plan import engine_step, sglang_api_key_path, teacher_engine_config, teacher_step
from hpc_rl.launch.steps import StepHandle, StepLauncher
from hpc_rl.launch.topology import JobTopology
from hpc_rl.process.child_process import free_port, http_ok, log_tail
from hpc_rl.protocol.http_client import EngineConnection, EngineHTTPTransportError

log = logging.getLogger("hpc_rl.driver")

ENGINE_BIND_RETRIES = 2
"""An engine whose port is taken is started again on a free port this many times, then the run fails."""
ROUTER_BIND_RETRIES = 2
"""The router is started again on free ports this many times when its ports are taken."""
ENGINE_HEALTH_POLL_S = 0.1
"""How often a starting engine's /health is asked (a refused connection until it listens; issue 11)."""
ENGINE_HEALTH_TIMEOUT_S = 2.0
"""How long one /health poll may take."""
EXTERNAL_ENGINE_WAIT_S = 10.0
"""At start, how long an external engine (rollout.rollout_external_engine_addrs) may take to answer /health."""


class Servers:
    """The run's engine, teacher and router processes (see the module docstring)."""

    def __init__(self, config: RunConfig, topology: JobTopology, launcher: StepLauncher, ports: PortPlan, *,
                 run_dir: Path, host: str, local: bool) -> None:
        self.config, self.topology, self.launcher, self.ports = config, topology, launcher, ports
        self.run_dir, self.logs, self.host, self.local = run_dir, run_dir / "logs", host, local
        self.engine_key = ""
        """The job's engine api key (the supervisor sets it from the secret). Never log it."""
        self.engine_steps: dict[int, StepHandle] = {}
        self.teacher_step: StepHandle | None = None
        """On-policy distillation's teacher engine (topology.teacher), once started."""
        self.router: RouterProcess | None = None

    def _engine_env(self, config: RunConfig, log_path: Path) -> dict[str, str]:
        env = build_sglang_env({}, {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        env[API_KEY_ENV] = self.engine_key  # in the environment: `ps` shows argv, not this
        if engine_kind(config.rollout.engine, config.cluster.device) == "sglang":
            env.update(SGLANG_ON_CPU_ENV if config.cluster.device == "cpu" else {})
            write_api_key_file(sglang_api_key_path(config), self.engine_key)
            _create_private(log_path)  # SGLang logs its server args, the key among them
        return env

    async def start_engine(self, index: int, *, retry_on_bind_failure: int = ENGINE_BIND_RETRIES,
                           tried: tuple[int, ...] = ()) -> str:
        """Start engine `index` and wait until it answers /health; return its URL. An engine that exits
        because its port is taken (another program bound it after the plan was made; on a remote node the
        driver cannot probe it) is started again on a free port, at most `retry_on_bind_failure` times."""
        placement = self.topology.engines[index]
        host = self.launcher.node_address(placement.het_group, placement.node_index)
        port = self.ports.engines[index]
        log_path = self.logs / f"engine-{index}.log"
        log_start = log_path.stat().st_size if log_path.exists() else 0
        env = self._engine_env(self.config, log_path)
        for node_rank in range(placement.num_nodes):  # this attempt writes its own
            engine_report_path(self.run_dir, index, node_rank).unlink(missing_ok=True)
        node_ports, dist_init_port = self.ports.engine_node_ports(placement)
        node_hosts = [self.launcher.node_address(placement.het_group, placement.node_index + rank)
                      for rank in range(placement.num_nodes)]
        step = self.launcher.start(engine_step(self.config, self.topology, index, host=host, port=port,
                                               run_dir=self.run_dir, env=env, local=self.local, node_hosts=node_hosts,
                                               node_ports=node_ports, dist_init_port=dist_init_port))
        self.engine_steps[index] = step
        url = f"http://{host}:{port}"
        try:
            await wait_healthy(url, step, 600.0, log_path, self.engine_key)
        except RuntimeError as error:
            if step.poll() is None or not bind_failed(log_since(log_path, log_start)):
                raise
            tried = (*tried, port)
            if retry_on_bind_failure <= 0:
                raise RuntimeError(
                    f"engine {index} could not bind a port on {host}: tried {', '.join(map(str, tried))}, each "
                    f"in use by another program; giving up after {len(tried)} attempt(s); last lines of "
                    f"{log_path}:\n{log_tail(log_path, 10)}") from error
            self.ports.engines[index] = free_port(host if host == self.host else "0.0.0.0")
            log.warning("engine %d could not bind port %d on %s; retrying on port %d", index, port, host,
                        self.ports.engines[index])
            return await self.start_engine(index, retry_on_bind_failure=retry_on_bind_failure - 1, tried=tried)
        return url

    async def stop_engine(self, index: int) -> None:
        """Stop engine `index`'s step, when it has one (before a restart)."""
        old = self.engine_steps.get(index)
        if old is not None:
            await asyncio.to_thread(old.stop, 5.0)

    def teacher_url(self) -> str | None:
        """Where the teacher engine serves (None: the job starts none)."""
        teacher = self.topology.teacher
        if teacher is None:
            return None
        return f"http://{self.launcher.node_address(teacher.het_group, teacher.node_index)}:{self.ports.teacher}"

    async def start_teacher(self) -> str:
        """On-policy distillation's teacher: the engine command (CPU engine or SGLang, as the rollout engines)
        on the teacher's checkpoint and GPUs, on its own het group; returns its URL once /health answers."""
        placement = self.topology.teacher
        assert placement is not None and self.ports.teacher is not None
        config = teacher_engine_config(self.config)
        host = self.launcher.node_address(placement.het_group, placement.node_index)
        log_path = self.logs / "teacher.log"
        env = self._engine_env(config, log_path)
        self.teacher_step = self.launcher.start(teacher_step(self.config, self.topology, host=host,
                                                             port=self.ports.teacher, run_dir=self.run_dir, env=env,
                                                             local=self.local))
        url = f"http://{host}:{self.ports.teacher}"
        await wait_healthy(url, self.teacher_step, 600.0, log_path, self.engine_key)
        log.info("teacher (on-policy distillation) serving %s at %s", config.checkpoint.hf_checkpoint, url)
        return url

    async def attach_external_engine(self, index: int, wait_s: float = EXTERNAL_ENGINE_WAIT_S) -> tuple[str, int]:
        """An engine another job serves: its URL and TP size once it answers /health and, with the job's engine
        key, /server_info. RuntimeError naming its address when it does not."""
        address = self.config.rollout.rollout_external_engine_addrs[index]
        url = external_engine_url(address)
        where = f"external engine {index} at {url} (rollout.rollout_external_engine_addrs: {address})"
        engine = EngineConnection(url, api_key=self.engine_key, connecting=asyncio.Semaphore(1))
        deadline, last = time.monotonic() + wait_s, "no answer"
        try:
            while True:
                try:
                    status, _ = await engine.request("GET", "/health", None, ENGINE_HEALTH_TIMEOUT_S)
                    if status == 200:
                        break
                    last = f"/health answered HTTP {status}"
                except EngineHTTPTransportError as error:
                    last = str(error)
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"{where} is unreachable: {last} (after {wait_s:.0f} s); is it running, and "
                                       "reachable from this node?")
                await asyncio.sleep(ENGINE_HEALTH_POLL_S * 5)
            status, answer = await engine.request("GET", "/server_info", None, 30.0)
        except EngineHTTPTransportError as error:
            raise RuntimeError(f"{where}: /server_info failed: {error}") from None
        finally:
            engine.close()
        if status != 200:
            raise RuntimeError(f"{where}: /server_info answered HTTP {status}"
                               + (": it needs another api key than this job's: start it without --api-key"
                                  if status == 401 else ""))
        return url, int(json.loads(answer).get("tp_size") or 1)

    async def start_router(self, retries: int = ROUTER_BIND_RETRIES) -> RouterProcess:
        """sglang-router on loopback (its only client is this process's controller; its /v1/models answers
        without the key), answering with the job's key. When its ports are taken (another run's router,
        which would answer /liveness too) it is started again on free ports, at most `retries` times."""
        log_path = self.logs / "router.log"
        for attempt in range(retries + 1):
            offset = log_path.stat().st_size if log_path.exists() else 0
            router = RouterProcess(log_path=log_path, host="127.0.0.1", port=self.ports.router,
                                   prometheus_port=self.ports.router_metrics,
                                   policy=self.config.sglang.router_policy, api_key=self.engine_key)
            router.start()
            if await asyncio.to_thread(_router_answers_with_key, router, self.engine_key, 60.0):
                self.router = router
                return router
            router.stop()
            output = log_since(log_path, offset)
            if not bind_failed(output) or attempt == retries:
                raise RuntimeError(f"sglang-router did not start at {router.url}; its log {log_path} says:\n"
                                   f"{output[-3000:]}")
            taken = (self.ports.router, self.ports.router_metrics)
            self.ports.router, self.ports.router_metrics = free_port("127.0.0.1"), free_port("127.0.0.1")
            log.warning("sglang-router could not bind port %d or %d on 127.0.0.1; retrying on ports %d and %d",
                        *taken, self.ports.router, self.ports.router_metrics)
        raise AssertionError("unreachable")

    async def stop(self) -> None:
        """Stop the engines and the teacher (at once), then the router."""
        await asyncio.gather(*(asyncio.to_thread(step.stop, 5.0) for step in
                               [*self.engine_steps.values(), *([self.teacher_step] if self.teacher_step else [])]))
        if self.router is not None:
            await asyncio.to_thread(self.router.stop)


def _router_answers_with_key(router: RouterProcess, api_key: str, timeout_s: float) -> bool:
    """True once the router answers a keyed request (`/workers`): it is ours (another run's router on the
    port answers /liveness, but refuses our key); False when ours exited first (its port was taken)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not router.process.alive():
            return False
        if http_ok(f"{router.url}/workers", timeout=2.0, api_key=api_key or None):
            return True
        time.sleep(0.1)
    raise RuntimeError(f"sglang-router did not answer at {router.url} within {timeout_s:.0f} s; "
                       f"see {router.process.log_path}")


def _create_private(path: Path) -> None:
    """Create `path` (if missing) readable by its owner only, before anything is written to it."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    os.chmod(path, 0o600)


async def wait_healthy(url: str, step: StepHandle, timeout_s: float, log_path: Path, api_key: str) -> None:
    """Until the step's server answers /health with 200; RuntimeError with its log's tail when it exits first
    or does not answer within `timeout_s`."""
    engine = EngineConnection(url, api_key=api_key, connecting=asyncio.Semaphore(1))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if step.poll() is not None:
                raise RuntimeError(f"{step.name} exited with code {step.poll()} before it was healthy; "
                                   f"last lines of {log_path}:\n{log_tail(log_path)}")
            try:
                if (await engine.request("GET", "/health", None, ENGINE_HEALTH_TIMEOUT_S))[0] == 200:
                    return
            except EngineHTTPTransportError:
                pass
            await asyncio.sleep(ENGINE_HEALTH_POLL_S)
    finally:
        engine.close()
    raise RuntimeError(f"{step.name} not healthy at {url}/health after {timeout_s:.0f} s; "
                       f"last lines of {log_path}:\n{log_tail(log_path)}")
