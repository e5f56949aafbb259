"""The driver: the job's first process. Runs the controller, the router, and starts every other step.

Owns: reading `<run_dir>/config.resolved.yaml` and the secret, per-component log files under
`<run_dir>/logs/`, starting sglang-router, one engine step per `EnginePlacement` (CPU engine or
SGLang; or, with rollout.rollout_external_engine_addrs, attaching to engines another job serves: none started,
an unreachable one named at start, a failed one waited for instead of restarted), the torchrun trainer step (c10d rendezvous on the first trainer node), registering engines
with the controller, supervising the steps (a dead engine goes to the fleet's failure path and is
restarted; a dead trainer ends the run with its log tail), and the shutdown order. The training modes: a
trainer-only job (SFT) starts no engine and no router; an on-policy-distillation teacher given as
`opd_teacher_hf_checkpoint` is one more engine step (its own het group), health-checked behind the job's key,
handed to the controller by URL, and stopped with the engines (a teacher that dies fails the run). The same code runs
locally (`LocalStepLauncher`) and inside a Slurm allocation (`SrunStepLauncher`); only the launcher differs.

Shutdown (success, failure, SIGINT/SIGTERM/scancel alike), every task the driver started is either
awaited or cancelled on purpose, so asyncio never reports an exception "never retrieved". SIGTERM (scancel,
preemption, `kill`) first saves the rollout the trainer last trained if that fits in the grace time
(`term_grace_s`: Slurm's KillWait minus a margin; 10 s on this machine) and sends the ranks their stop
command (`controller.signal_stop`); SIGINT (Ctrl-C) stops at once:

    signal ──> controller.stopping (a trainer or engine that now disconnects is not a failure)
           ──> cancel the main task ──> shutdown():
                 health checks and restarts off ──> cancel the controller's run task and wait for it
                 (its rollout aborts, its weight sync unwinds; an error it ends with is logged once)
                 ──> pending engine-failure tasks ──> trainer step ──> engines ──> router
                 ──> Controller.close()

The job's engine key (derived from the secret: `engine_api_key`) guards every engine endpoint but
/health and the router's own endpoints; the controller presents it on each call. It never goes on a
command line (`ps` shows those) nor into hpc_rl's logs: engines and the router get it in their
environment (`API_KEY_ENV`), SGLang (which reads no variable for it) in a 0600 `--config` file of the
run dir; SGLang logs it itself at start, so SGLang engine logs are created 0600.

A node that dies under the job (Slurm only): the driver asks Slurm about the job's nodes every
NODE_WATCH_INTERVAL_S (`hpc_rl.launch.node_health`); once one is lost (not answering Slurm's pings, or
DOWN) it names the node and the steps it ran, and requeues the job while `controller.max_restarts`
allows (the same count as the batch guard's requeues; the requeued job resumes from the last
checkpoint and its status.json lists the requeue), else the run fails with that message.

Exit codes: 0 done, 1 failed, 3 stopped for checkpoint-and-requeue (USR2), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_rl.config import RunConfig, load_resolved_config
from hpc_rl.config.sglang_options import engine_kind, external_engine_url
from hpc_rl.controller.app import Controller
from hpc_rl.controller.signal_stop import stop_with_checkpoint
from hpc_rl.controller.stopping import log_task_error, stop_task
from hpc_rl.engines import API_KEY_ENV
from hpc_rl.process.child_process import free_port, http_ok, log_tail, planned_port
from hpc_rl.engines.router import RouterProcess
from hpc_rl.engines.gpu_step import engine_report_path
from hpc_rl.engines.sglang_launch import SGLANG_ON_CPU_ENV, build_sglang_env, write_api_key_file
from hpc_rl.launch.batch_guard import RESTARTS_FILE, restarts_used
from hpc_rl.launch.bound_torchrun import STORE_ADDRESS_ENV
from hpc_rl.launch.node_health import NodeLoss, lost_nodes, query_node_states
from hpc_rl.launch.orphans import become_subreaper, end_children, environ_has
from hpc_rl.launch.submit_args import EXIT_INVALID
from hpc_rl.launch.run_lock import RunDirLocked, acquire
from hpc_rl.launch.steps import LocalStepLauncher, StepHandle, StepLauncher
from hpc_rl.launch.trainer_exit import describe_trainer_exit
from hpc_rl.launch.step_plan import (
    engine_step, sglang_api_key_path, teacher_engine_config, teacher_step, trainer_step,
)
from hpc_rl.launch.topology import DIST_INIT_PORT_OFFSET, EnginePlacement, JobTopology, node_rank_port, plan_run_topology
from hpc_rl.protocol.http_client import EngineConnection, EngineHTTPTransportError
from hpc_rl.protocol.secret import Secret, engine_api_key, load_secret, secret_path
from hpc_rl.telemetry.run_files import RunLogFileHandler

log = logging.getLogger("hpc_rl.driver")

EXIT_OK, EXIT_FAILED, EXIT_REQUEUE, EXIT_INTERRUPTED = 0, 1, 3, 130
CONTROLLER_ENV = "HPC_RL_CONTROLLER"
RUN_DIR_ENV = "HPC_RL_RUN_DIR"
TRAINER_NODE_ADDRESSES_ENV = "HPC_RL_TRAINER_NODE_ADDRESSES"  # read by hpc_rl.training.sync_address


ENGINE_BIND_RETRIES = 2
"""An engine whose port is taken is started again on a free port this many times, then the run fails."""
ENGINE_HEALTH_POLL_S = 0.1
"""How often a starting engine's /health is asked (a refused connection until it listens; issue 11)."""
ENGINE_HEALTH_TIMEOUT_S = 2.0
"""How long one /health poll may take."""
EXTERNAL_ENGINE_WAIT_S = 10.0
"""At start, how long an external engine (rollout.rollout_external_engine_addrs) may take to answer /health."""
EXTERNAL_ENGINE_RETURN_S = 600.0
"""After an external engine failed: how long the run waits for it to answer again (another job restarts it)."""
NODE_WATCH_INTERVAL_S = 2.0
"""On Slurm, how often the driver asks whether the job's nodes are alive (one `sinfo` call)."""
NODE_REQUEUE_WAIT_S = 120.0
"""After requeuing for a lost node: how long an engine restart waits for Slurm to stop this attempt."""

LOCAL_OS_PICKS = 0
"""A local run's controller and rendezvous store bind port 0 (the OS picks a free port as they bind):
a planned port can be taken by another run between the plan and the bind (two local runs once failed
with "Address already in use" on torchrun's store). The router and engines have planned ports, and
are started again on free ones when theirs are taken."""

JOB_PORT_SLOTS = 300
"""Slurm jobs whose ids differ by less than this never share a planned port (15000 + slot * 50 stays
below 30000, under Linux's ephemeral range, where free_port's replacements come from)."""


@dataclass
class PortPlan:
    """Ports of this job's servers: free ones locally; on Slurm the topology's ports shifted by the job's
    slot (job id % JOB_PORT_SLOTS, 50 ports each), and any of those found in use on the driver's own node
    (a port squatter, another program) replaced by a free one before anything binds."""

    controller: int
    router: int
    router_metrics: int
    rendezvous: int
    engines: list[int]
    """Each engine's HTTP port (a multi-node engine's node-rank 0)."""
    spans: dict[int, list[int]] = field(default_factory=dict)
    """A local run's multi-node engines: [distributed-init port, node-rank 1's port, ...] (on Slurm they follow
    from node-rank 0's port: `topology.node_rank_port`)."""
    teacher: int | None = None
    """The on-policy-distillation teacher engine's port (when the job starts one)."""

    @classmethod
    def for_job(cls, topology: JobTopology, *, local: bool) -> "PortPlan":
        if local:  # the controller and torchrun's rendezvous store bind port 0: the OS picks a free one
            return cls(LOCAL_OS_PICKS, planned_port(), planned_port(), LOCAL_OS_PICKS,
                       [planned_port() for _ in topology.engines],
                       {e.engine_index: [planned_port() for _ in range(e.num_nodes)]
                        for e in topology.engines if e.num_nodes > 1},
                       teacher=planned_port() if topology.teacher is not None else None)
        offset = (int(os.environ.get("SLURM_JOB_ID", "0")) % JOB_PORT_SLOTS) * 50
        return cls(topology.controller_port + offset, topology.router_port + offset,
                   topology.router_metrics_port + offset, topology.rendezvous_port + offset,
                   [e.port + offset for e in topology.engines],
                   teacher=topology.teacher.port + offset if topology.teacher is not None else None)

    def avoiding_busy(self, host: str, engine_hosts: list[str]) -> "PortPlan":
        """This plan with each port that is in use on `host` replaced by a free one (engines only when
        they run on `host`: a remote node's ports cannot be probed from here; see Driver.start_engine)."""

        def checked(name: str, port: int, on: str = host) -> int:
            if not port_in_use(on, port):
                return port
            replacement = free_port(on)
            log.warning("port %d on %s (%s) is in use; using %d instead", port, on, name, replacement)
            return replacement

        # the router listens on loopback (its only client is the controller in this process)
        return PortPlan(checked("controller", self.controller), checked("router", self.router, "127.0.0.1"),
                        checked("router metrics", self.router_metrics, "127.0.0.1"),
                        checked("rendezvous", self.rendezvous),
                        [checked(f"engine {i}", port) if engine_hosts[i] == host else port
                         for i, port in enumerate(self.engines)], self.spans, teacher=self.teacher)

    def engine_node_ports(self, placement: EnginePlacement) -> tuple[list[int], int]:
        """A multi-node engine's port of each node-rank and node-rank 0's distributed-init port."""
        port = self.engines[placement.engine_index]
        if placement.engine_index in self.spans:
            dist_init, *followers = self.spans[placement.engine_index]
            return [port, *followers], dist_init
        return ([node_rank_port(port, rank) for rank in range(placement.num_nodes)],
                port + DIST_INIT_PORT_OFFSET)


def port_in_use(host: str, port: int) -> bool:
    """Whether binding `host:port` fails now (something listens there, or binds it without SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


ROUTER_BIND_RETRIES = 2
"""The router is started again on free ports this many times when its ports are taken."""


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


def bind_failed(log_text: str) -> bool:
    """A server's log says its port was taken (Python, aiohttp, Rust and SGLang wordings)."""
    text = log_text.lower()
    return "address already in use" in text or "errno 98" in text or "eaddrinuse" in text


def _log_since(path: Path, offset: int) -> str:
    """What a step wrote to its (appended) log since `offset`: the output of this attempt only."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _create_private(path: Path) -> None:
    """Create `path` (if missing) readable by its owner only, before anything is written to it."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    os.chmod(path, 0o600)


async def _wait_healthy(url: str, step: StepHandle, timeout_s: float, log_path: Path, api_key: str) -> None:
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


class Driver:
    """Starts and supervises one run's processes (see the module docstring)."""

    _node_watch: asyncio.Task[None] | None = None
    """The node watch task (Slurm only; started in `run`, stopped first in `shutdown`)."""
    teacher_step: StepHandle | None = None
    """On-policy distillation's teacher engine (topology.teacher), once started."""

    def __init__(self, run_dir: str | Path, launcher: StepLauncher, *, local: bool) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.config = load_resolved_config(self.run_dir)
        self.launcher = launcher
        self.local = local
        self.topology = plan_run_topology(self.config)
        self.ports = PortPlan.for_job(self.topology, local=local)
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.host = launcher.node_address(0, 0)
        if not local:
            engine_hosts = [launcher.node_address(e.het_group, e.node_index) for e in self.topology.engines]
            self.ports = self.ports.avoiding_busy(self.host, engine_hosts)
        self.engine_steps: dict[int, StepHandle] = {}
        self.trainer_step: StepHandle | None = None
        self.router: RouterProcess | None = None
        self.controller: Controller | None = None
        self.requeue_requested = False
        self.failure: Exception | None = None
        """What ended the run, when it failed (run_driver decides on a restart from it)."""
        self.restarts: list[dict[str, Any]] = []
        """Earlier attempts of this job that failed and were restarted (shown in status.json)."""
        self.run_task: asyncio.Task[dict[str, object]] | None = None
        """The controller's run while `run` waits on it; if `run` is interrupted, `shutdown` stops it."""
        self._engine_failures: dict[int, asyncio.Task[None]] = {}
        self.engine_key = ""
        """The job's engine api key (set in `run` from the secret). Never log it."""
        self.lost: dict[str, NodeLoss] = {}
        """Nodes of the job Slurm reports lost (Slurm only), each reported once."""
        self.node_requeued = False
        """The driver requeued the job after losing a node (Slurm now stops this attempt)."""
        self.node_failure: str | None = None
        """A node was lost and the job could not be requeued: the run fails with this."""
        self._node_check = asyncio.Lock()
        """One check at a time: an engine restart asking about its node waits for the watch's decision."""
        self.graceful_stop: asyncio.Task[None] | None = None
        """After SIGTERM: the task that saves what the grace time allows and ends the controller's run."""
        self.controller_run: asyncio.Task[dict[str, object]] | None = None
        """The controller's run, from its start on (also after `run` took over its outcome)."""

    # -- engines -------------------------------------------------------------------------------------------
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
        env = build_sglang_env({}, {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        env[API_KEY_ENV] = self.engine_key  # in the environment: `ps` shows argv, not this
        if engine_kind(self.config.rollout.engine, self.config.cluster.device) == "sglang":
            env.update(SGLANG_ON_CPU_ENV if self.config.cluster.device == "cpu" else {})
            write_api_key_file(sglang_api_key_path(self.config), self.engine_key)
            _create_private(log_path)  # SGLang logs its server args, the key among them
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
            await _wait_healthy(url, step, 600.0, log_path, self.engine_key)
        except RuntimeError as error:
            if step.poll() is None or not bind_failed(_log_since(log_path, log_start)):
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

    async def start_teacher(self) -> str:
        """On-policy distillation's teacher: the engine command (CPU engine or SGLang, as the rollout engines)
        on the teacher's checkpoint and GPUs, on its own het group; returns its URL once /health answers."""
        placement = self.topology.teacher
        assert placement is not None and self.ports.teacher is not None
        config = teacher_engine_config(self.config)
        host = self.launcher.node_address(placement.het_group, placement.node_index)
        log_path = self.logs / "teacher.log"
        env = build_sglang_env({}, {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        env[API_KEY_ENV] = self.engine_key  # in the environment: `ps` shows argv, not this
        if engine_kind(config.rollout.engine, config.cluster.device) == "sglang":
            env.update(SGLANG_ON_CPU_ENV if config.cluster.device == "cpu" else {})
            write_api_key_file(sglang_api_key_path(config), self.engine_key)
            _create_private(log_path)
        self.teacher_step = self.launcher.start(teacher_step(self.config, self.topology, host=host,
                                                             port=self.ports.teacher, run_dir=self.run_dir, env=env,
                                                             local=self.local))
        url = f"http://{host}:{self.ports.teacher}"
        await _wait_healthy(url, self.teacher_step, 600.0, log_path, self.engine_key)
        log.info("teacher (on-policy distillation) serving %s at %s", config.checkpoint.hf_checkpoint, url)
        return url

    # -- external engines (rollout.rollout_external_engine_addrs) ---------------------------------------------
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

    async def restart_engine(self, index: int) -> str:
        if self.config.rollout.rollout_external_engine_addrs:  # not ours to start: wait until it answers again
            log.warning("external engine %d failed; waiting up to %.0f s for it to answer again", index,
                        EXTERNAL_ENGINE_RETURN_S)
            return (await self.attach_external_engine(index, EXTERNAL_ENGINE_RETURN_S))[0]
        old = self.engine_steps.get(index)
        if old is not None:
            await asyncio.to_thread(old.stop, 5.0)
        nodes = self.nodes_of_engine(index)
        if nodes:  # a step on a dead node waits in srun until Slurm ends the job: do not start one
            for loss in await self.check_nodes(nodes):
                if self.node_requeued:  # Slurm stops this attempt now (SIGTERM); a restart would only race it
                    await asyncio.sleep(NODE_REQUEUE_WAIT_S)
                raise RuntimeError(f"engine {index} is not restarted: {loss.describe(self.steps_on(loss.node))}")
        return await self.start_engine(index)

    # -- nodes (Slurm) -------------------------------------------------------------------------------------
    def nodes_of_engine(self, index: int) -> list[str]:
        """The nodes engine `index` runs on (a multi-node engine: all of them; [] when not known)."""
        placement = self.topology.engines[index]
        nodes = self._hostnames(placement.het_group) or []
        return nodes[placement.node_index:placement.node_index + placement.num_nodes]

    def steps_on(self, node: str) -> list[str]:
        """The names of this run's steps with a task on `node` ('trainer', 'engine-0', ...)."""
        steps = [f"engine-{i}" for i in range(len(self.topology.engines)) if node in self.nodes_of_engine(i)]
        trainer_nodes = (self._hostnames(0) or [])[:self.config.cluster.actor_num_nodes]
        if node in trainer_nodes:
            steps.insert(0, f"trainer (node {trainer_nodes.index(node)} of {len(trainer_nodes)})")
        if trainer_nodes and node == trainer_nodes[0]:
            steps.insert(0, "the driver (controller, router)")
        return steps

    def job_nodes(self) -> list[str]:
        groups = {0, *(e.het_group for e in self.topology.engines),
                  *([self.topology.teacher.het_group] if self.topology.teacher else [])}
        return sorted({node for group in groups for node in (self._hostnames(group) or [])})

    def _hostnames(self, het_group: int) -> list[str] | None:
        hostnames = getattr(self.launcher, "hostnames", None)
        if hostnames is None or self.local:
            return None
        try:
            return list(hostnames(het_group))
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError):
            return None

    async def check_nodes(self, nodes: list[str] | None = None) -> list[NodeLoss]:
        """Ask Slurm about the job's nodes (or `nodes`); report each newly lost one (log, stderr,
        status.json's last_error) and return every lost one asked about."""
        if self.local:
            return []
        asked = self.job_nodes() if nodes is None else nodes
        async with self._node_check:
            return await self._report_losses(lost_nodes(await asyncio.to_thread(query_node_states, asked)))

    async def _report_losses(self, losses: list[NodeLoss]) -> list[NodeLoss]:
        for loss in losses:
            if loss.node not in self.lost:
                self.lost[loss.node] = loss
                message = f"{loss.describe(self.steps_on(loss.node))}; {await self._after_node_loss()}"
                log.error(message)
                print(f"hpc_rl: {message}", file=sys.stderr, flush=True)
                if self.controller is not None:
                    self.controller.last_error = f"NodeLost: {message}"
                if not self.node_requeued:
                    self.node_failure = message
        return losses

    async def _after_node_loss(self) -> str:
        """The job lost a node: requeue it while controller.max_restarts allows (counted with the batch
        guard's requeues), else the run fails. Returns what was done, for the message."""
        if self.node_requeued:
            return "the job is already requeued"
        used, limit = restarts_used(self.run_dir), self.config.controller.max_restarts
        job_id = os.environ.get("SLURM_JOB_ID", "")
        if used >= limit or not job_id:
            return (f"the run fails (no restart left: controller.max_restarts={limit}, used {used}); its last "
                    "checkpoint is kept: submit again with the same --run-dir to resume")
        (self.run_dir / RESTARTS_FILE).write_text(f"{used + 1}\n")
        requeue = await asyncio.to_thread(subprocess.run, ["scontrol", "requeue", job_id], capture_output=True,
                                          text=True, timeout=60)
        if requeue.returncode != 0:
            return f"the run fails (scontrol requeue {job_id} failed: {requeue.stderr.strip() or requeue.returncode})"
        self.node_requeued = True
        return (f"requeued job {job_id} to resume from the last checkpoint on healthy nodes (restart {used + 1} "
                f"of controller.max_restarts={limit})")

    async def _watch_nodes(self) -> None:
        while True:
            await asyncio.sleep(NODE_WATCH_INTERVAL_S)
            await self.check_nodes()

    # -- the run -------------------------------------------------------------------------------------------
    async def run(self) -> int:
        secret = load_secret(secret_path(self.run_dir))
        self.engine_key = engine_api_key(secret)
        external = [await self.attach_external_engine(i)  # first: an unreachable one fails the run at once
                    for i in range(len(self.config.rollout.rollout_external_engine_addrs))]
        # Engines need neither the router nor the controller until they register: they load (seconds of
        # imports and the model) while those two come up (issue 11). The tasks run from the first await.
        starts = [asyncio.create_task(self.start_engine(i), name=f"start engine {i}")
                  for i in range(len(self.topology.engines))]
        if self.topology.teacher is not None:
            starts.append(asyncio.create_task(self.start_teacher(), name="start the teacher"))
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
        self.run_task = self.controller_run = run
        while not run.done():
            await asyncio.wait({run}, timeout=1.0)
            self._supervise(run)
            if self.node_failure is not None:
                raise RuntimeError(self.node_failure)
        if self.graceful_stop is not None:  # SIGTERM: it ended the run (and read its outcome)
            await self.graceful_stop
            raise StoppedBySignal()
        self.run_task = None  # its outcome is ours now: raised from here, not left to shutdown()
        try:
            run.result()
        except Exception as error:
            if _is_trainer_failure(error) and not getattr(error, "process_alive", False):  # (a stopped rank: no exit)
                explained = _trainer_failed(await self.explain_trainer_failure(str(error)))
                self.controller.last_error = f"TrainerFailed: {explained}"  # what status.json shows
                raise explained from error
            raise
        waited = time.perf_counter()
        code = await asyncio.to_thread(self.trainer_step.wait, 120.0)
        log.info("the trainer exited %.2f s after the run (code %d)", time.perf_counter() - waited, code)
        if code != 0:
            raise RuntimeError(f"the trainer exited with code {code} after the run; see {self.logs / 'trainer.log'}")
        return EXIT_REQUEUE if self.controller.loop and self.controller.loop.stopped_for_requeue else EXIT_OK

    async def _start_control_plane(self, secret: Secret) -> None:
        """The router (not in a trainer-only job), then the controller (listening), then (not colocated) the
        trainer step."""
        if not self.topology.trainer_only:
            self.router = await self._start_router()
        teacher = self.topology.teacher
        teacher_url = (f"http://{self.launcher.node_address(teacher.het_group, teacher.node_index)}:{self.ports.teacher}"
                       if teacher is not None else None)
        self.controller = Controller(self.config, secret=secret, router=self.router,
                                     router_url=self.router.url if self.router else None,
                                     restart_engine=self.restart_engine, host=self.host, port=self.ports.controller,
                                     api_key=self.engine_key, teacher_url=teacher_url)
        self.controller.restarts = self.restarts
        await self.controller.start()
        if not self.local:
            self._node_watch = asyncio.create_task(self._watch_nodes(), name="node-watch")
        self._apply_requeue_request()
        if not self.topology.colocate:  # trainer ranks load while the engines do (issue 11); colocated
            self._start_trainer()       # ranks wait: SGLang sizes its KV cache from the GPU memory then free

    async def _start_router(self, retries: int = ROUTER_BIND_RETRIES) -> RouterProcess:
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
                return router
            router.stop()
            output = _log_since(log_path, offset)
            if not bind_failed(output) or attempt == retries:
                raise RuntimeError(f"sglang-router did not start at {router.url}; its log {log_path} says:\n"
                                   f"{output[-3000:]}")
            taken = (self.ports.router, self.ports.router_metrics)
            self.ports.router, self.ports.router_metrics = free_port("127.0.0.1"), free_port("127.0.0.1")
            log.warning("sglang-router could not bind port %d or %d on 127.0.0.1; retrying on ports %d and %d",
                        *taken, self.ports.router, self.ports.router_metrics)
        raise AssertionError("unreachable")

    def _start_trainer(self) -> None:
        assert self.controller is not None
        rendezvous = f"{self.host}:{self.ports.rendezvous}"
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
        how = describe_trainer_exit(step.poll(), self.logs / "trainer.log", self.trainer_node_names())
        return f"{how}; the controller saw: {seen_by_controller}; log: {self.logs / 'trainer.log'}"

    def trainer_node_names(self) -> list[str] | None:
        hostnames = getattr(self.launcher, "hostnames", None)
        if hostnames is None:
            return None
        try:
            return list(hostnames(0))
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError):
            return None

    def request_checkpoint(self) -> None:
        """USR2 (time limit or preemption ahead): save at the next rollout boundary, then stop for requeue.
        A USR2 that arrives before the controller's loop exists (Slurm may signal early) is kept for it."""
        log.warning("checkpoint-and-requeue requested")
        self.requeue_requested = True
        self._apply_requeue_request()

    def _apply_requeue_request(self) -> None:
        if self.requeue_requested and self.controller is not None and self.controller.loop is not None:
            self.controller.loop.stop_requested = True

    def stop_gracefully(self, main: asyncio.Task[Any]) -> None:
        """SIGTERM: save what the grace time allows, then stop (one before the controller runs stops at
        once). Another SIGTERM changes nothing: Slurm delivers scancel's to the batch step twice (to the
        guard's process group and through the guard); SIGINT stops at once."""
        if self.graceful_stop is not None:
            log.info("SIGTERM again: already stopping (SIGINT stops at once)")
            return
        if self.controller_run is None or self.controller is None:
            self.note_stopping()
            main.cancel()
            return
        self.graceful_stop = asyncio.create_task(self._stop_gracefully(self.controller_run), name="graceful stop")

    async def stopped_by_signal_meanwhile(self, error: Exception, wait_s: float = 1.0) -> bool:
        """Whether a SIGTERM comes within `wait_s` of the run ending with `error` (then its graceful stop
        has run). On Slurm, scancel and preemption signal every step at once: an engine or the trainer can
        die a moment before the driver's own SIGTERM arrives, and the run must then stop (saving what it
        can), not fail with a traceback."""
        deadline = time.monotonic() + wait_s
        while self.graceful_stop is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.graceful_stop is None:
            return False
        log.warning("SIGTERM came as the run ended with %s: %s (Slurm signals every step at once): a stop, not a "
                    "failure", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        await self.graceful_stop
        return True

    async def _stop_gracefully(self, run: asyncio.Task[Any]) -> None:
        assert self.controller is not None
        grace = term_grace_s(local=self.local)
        message = f"SIGTERM: stopping; a checkpoint is saved if one can be within {grace:.0f} s"
        log.warning(message)
        print(f"hpc_rl: {message}", file=sys.stderr, flush=True)
        began = time.perf_counter()
        self.controller.fleet.restart = None  # an engine that dies now (Slurm signals every step) stays down
        await self.controller.fleet.stop_monitoring()
        outcome = await stop_with_checkpoint(self.controller.loop, self.controller.channel, run, grace)
        self.controller.outcome = "stopped"
        log.warning("%s (%.1f s after SIGTERM)", outcome, time.perf_counter() - began)
        print(f"hpc_rl: {outcome} ({time.perf_counter() - began:.1f} s after SIGTERM)", file=sys.stderr, flush=True)

    def note_stopping(self) -> None:
        """A stop was asked for (signal): from now on a component that goes away is not a failure."""
        if self.controller is not None:
            self.controller.stopping = True

    def _supervise(self, run: asyncio.Task[Any]) -> None:
        assert self.controller is not None and self.trainer_step is not None
        code = self.trainer_step.poll()
        if code is not None and not run.done() and self.controller.channel.failure is None:
            self.controller.channel.fail(_trainer_failed(
                f"{describe_trainer_exit(code, self.logs / 'trainer.log', self.trainer_node_names())}; "
                f"last lines of {self.logs / 'trainer.log'}:\n{log_tail(self.logs / 'trainer.log')}"))
        if self.teacher_step is not None and self.teacher_step.poll() is not None and not run.done() \
                and self.controller.channel.failure is None:
            raise RuntimeError(f"the distillation teacher exited with code {self.teacher_step.poll()}; last lines of "
                               f"{self.logs / 'teacher.log'}:\n{log_tail(self.logs / 'teacher.log')}")
        for index, task in list(self._engine_failures.items()):
            if task.done():
                del self._engine_failures[index]
                log_task_error(task)
        for index, step in list(self.engine_steps.items()):
            engine = self.controller.registry.engines.get(index)
            if (step.poll() is not None and engine is not None and engine.state.value != "failed"
                    and index not in self._engine_failures):
                reason = f"process exited with code {step.poll()}"
                self._engine_failures[index] = asyncio.create_task(
                    self.controller.fleet.fail_engine(index, reason), name=f"fail engine {index}")

    async def shutdown(self) -> None:
        """Stop every task and process of the run, in the order of the module docstring."""
        self.note_stopping()
        if self._node_watch is not None:
            await stop_task(self._node_watch, "the node watch", timeout_s=30.0)
            self._node_watch = None
        if self.controller is not None:
            await self.controller.fleet.stop_monitoring()
        if self.run_task is not None:
            await stop_task(self.run_task, "the controller's run", timeout_s=60.0)
        for task in self._engine_failures.values():
            await stop_task(task, task.get_name(), timeout_s=30.0)
        self._engine_failures.clear()
        began = time.perf_counter()
        if self.trainer_step is not None:
            await asyncio.to_thread(self.trainer_step.stop, 15.0)
        await asyncio.gather(*(asyncio.to_thread(step.stop, 5.0) for step in
                               [*self.engine_steps.values(), *([self.teacher_step] if self.teacher_step else [])]))
        if self.router is not None:
            await asyncio.to_thread(self.router.stop)
        if self.controller is not None:
            await self.controller.close()
        if self.local:  # what a killed torchrun agent left (its ranks' helpers) was adopted here: end it
            mine = str(self.run_dir)
            ended = await asyncio.to_thread(end_children, keep=lambda pid: not environ_has(pid, RUN_DIR_ENV, mine))
            for pid in ended:
                log.warning("ended pid %d, a process of the run left behind by its parent", pid)
        log.info("every process of the run stopped in %.2f s", time.perf_counter() - began)


class StoppedBySignal(Exception):
    """SIGTERM ended the run (after saving what it could): exit code EXIT_INTERRUPTED, no traceback."""


TERM_GRACE_LOCAL_S = 10.0
"""What SIGTERM grants a run on this machine before it must be gone (a `kill`, `docker stop` and systemd
give 10 s before SIGKILL)."""
TERM_GRACE_MARGIN_S = 3.0
"""Of Slurm's KillWait, what is kept for stopping the processes after the save."""


def term_grace_s(*, local: bool) -> float:
    """Seconds from SIGTERM to the end of the save: locally TERM_GRACE_LOCAL_S; in a Slurm job, Slurm's
    KillWait (SIGTERM to SIGKILL on scancel and preemption; default 30 s) minus TERM_GRACE_MARGIN_S."""
    if local:
        return TERM_GRACE_LOCAL_S
    try:
        shown = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        shown = ""
    return max(0.0, slurm_kill_wait_s(shown) - TERM_GRACE_MARGIN_S)


def slurm_kill_wait_s(scontrol_config: str, default: float = 30.0) -> float:
    """KillWait from `scontrol show config` ("KillWait = 30 sec"); Slurm's default when absent."""
    for line in scontrol_config.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait":
            words = value.split()
            if words and words[0].isdigit():
                return float(words[0])
    return default


def _trainer_failed(message: str):  # -> TrainerFailed
    from hpc_rl.controller.trainer_channel import TrainerFailed

    return TrainerFailed(message)


def _is_trainer_failure(error: BaseException) -> bool:
    from hpc_rl.controller.trainer_channel import TrainerFailed

    return isinstance(error, TrainerFailed)


def setup_logging(run_dir: Path, level: str) -> None:
    """hpc_rl's records to `logs/controller.log` (warnings also to stderr), through the `hpc_rl` logger:
    the root logger and its handlers stay the application's (a library user keeps theirs). Idempotent."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    file_handler = RunLogFileHandler(run_dir / "logs" / "controller.log")  # a full disk: one line, not one per record
    file_handler.setFormatter(formatter)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(formatter)
    console.setLevel(logging.WARNING)
    package = logging.getLogger("hpc_rl")
    for handler in [h for h in package.handlers if getattr(h, "hpc_rl_run_log", False)]:
        package.removeHandler(handler)
        handler.close()
    for handler in (file_handler, console):
        handler.hpc_rl_run_log = True  # type: ignore[attr-defined]
        package.addHandler(handler)
    package.setLevel(level)


def run_driver(run_dir: str | Path, launcher: StepLauncher, *, local: bool) -> int:
    """Run the whole job; returns an exit code (see the module docstring).

    A run that fails because a trainer rank died starts again from the last checkpoint, up to
    `controller.max_restarts` times (every process of the failed attempt is stopped first); each
    restart is printed, logged and listed in status.json under "restarts"."""
    job_id = None if local else os.environ.get("SLURM_JOB_ID") or None
    try:  # one run per run dir (a requeued attempt of this job, or this process's submit, hands it over)
        lock = acquire(Path(run_dir).resolve(), role="driver", job_id=job_id)
    except RunDirLocked as busy:
        print(f"hpc_rl: {busy}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    lock.start_heartbeat()
    if local:
        become_subreaper()  # orphans of the run's processes come here, and are ended at shutdown
    code = EXIT_FAILED
    try:
        code = _run_attempts(run_dir, launcher, local=local)
    finally:
        if not local:  # the job may run again (a requeue); Slurm's state of it says when it ended for good
            lock.keep()
        lock.release()
    return code


def _run_attempts(run_dir: str | Path, launcher: StepLauncher, *, local: bool) -> int:
    restarts = requeued_attempts(Path(run_dir).resolve())
    # before the first Driver: its constructor already logs (ports found in use on the node)
    setup_logging(Path(run_dir).resolve(), load_resolved_config(Path(run_dir).resolve()).logging.log_level)
    while True:
        if (refused := _resume_refused(Path(run_dir).resolve())) is not None:
            return refused
        driver = Driver(run_dir, launcher, local=local)
        driver.restarts = restarts
        code = asyncio.run(_drive(driver))
        limit = driver.config.controller.max_restarts
        if code != EXIT_FAILED or driver.failure is None or not _is_trainer_failure(driver.failure):
            return code
        if len(restarts) >= limit:
            if limit:
                print(f"hpc_rl: no restart left (controller.max_restarts={limit} used)", file=sys.stderr, flush=True)
            return code
        restarts.append({"at": time.time(), "reason": str(driver.failure).split("\n")[0]})
        message = (f"restarting from the last checkpoint (restart {len(restarts)} of {limit}) after: "
                   f"{restarts[-1]['reason']}")
        log.warning(message)
        print(f"hpc_rl: {message}", file=sys.stderr, flush=True)


def _resume_refused(run_dir: Path) -> int | None:
    """Before any process of an attempt starts: which checkpoint it resumes from (one line when some were
    skipped), or EXIT_INVALID when the checkpoint dir holds checkpoints and none is whole (run_attempts)."""
    from hpc_rl.launch.run_attempts import check_resume

    skipped, refusal = check_resume(load_resolved_config(run_dir), "the same command with")
    if refusal is not None:
        log.error("%s", refusal)
        return EXIT_INVALID
    if skipped is not None:
        log.warning("%s", skipped)
    return None


def requeued_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """In a job Slurm requeued (SLURM_RESTART_COUNT > 0: a node failed, the time limit came, the driver
    died): the restarts the last status.json listed, plus one for the attempt that ended before this one,
    with what it said (so status.json keeps saying what happened). [] in a first attempt."""
    try:
        requeues = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        requeues = 0
    if requeues <= 0:
        return []
    try:
        status = json.loads((run_dir / "status.json").read_text())
        earlier = [r for r in status.get("restarts") or [] if isinstance(r, dict)]
        last_error, state, at = str(status.get("last_error") or ""), status.get("state"), status.get("updated_at")
    except (OSError, ValueError, AttributeError):
        earlier, last_error, state, at = [], "", None, None
    if last_error:
        why = last_error.splitlines()[0]
    elif state == "stopped":
        why = "the attempt saved and stopped (time limit, preemption or a signal)"
    else:
        why = f"the attempt ended without a word (state {state or 'unknown'}: its driver or node died?)"
    return earlier + [{"at": at or time.time(), "reason": f"job requeued by Slurm (requeue {requeues}) after: {why}"}]


async def _drive(driver: Driver) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def interrupt() -> None:
        driver.note_stopping()
        task.cancel()

    loop.add_signal_handler(signal.SIGINT, interrupt)
    loop.add_signal_handler(signal.SIGTERM, lambda: driver.stop_gracefully(task))
    loop.add_signal_handler(signal.SIGUSR2, driver.request_checkpoint)
    try:
        return await driver.run()
    except StoppedBySignal:
        log.info("stopped by SIGTERM")
        return EXIT_INTERRUPTED
    except asyncio.CancelledError:
        log.info("interrupted by a signal; stopping every process of the run")
        print("hpc_rl: interrupted; stopping every process of the run", file=sys.stderr, flush=True)
        if await driver.check_nodes():  # Slurm ends a job whose node went DOWN: say which one and why
            log.error("the job is being ended by Slurm because node(s) %s failed", ", ".join(driver.lost))
        return EXIT_INTERRUPTED
    except Exception as error:
        if not driver.local and await driver.stopped_by_signal_meanwhile(error):
            return EXIT_INTERRUPTED
        driver.failure = error
        log.exception("run failed")
        print(f"hpc_rl: the run failed: {error}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
        await driver.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one hpc_rl job from its run directory (the batch step).")
    parser.add_argument("--run-dir", required=True, help="run directory with config.resolved.yaml and secret")
    parser.add_argument("--launcher", choices=("local", "srun"), default="local")
    args = parser.parse_args(argv)
    if args.launcher == "srun":
        from hpc_rl.launch.sbatch_render import engine_cpus_per_task
        from hpc_rl.launch.srun_launcher import SrunStepLauncher

        config = load_resolved_config(args.run_dir)  # engines' srun steps get their component's CPUs
        cpus = engine_cpus_per_task(config, plan_run_topology(config))
        return run_driver(args.run_dir, SrunStepLauncher(cpus_per_task=cpus), local=False)
    return run_driver(args.run_dir, LocalStepLauncher(), local=True)


if __name__ == "__main__":
    raise SystemExit(main())
