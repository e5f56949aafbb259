"""The driver's watch over the job's nodes (Slurm only): which node was lost, what ran there, requeue or fail.

Every NODE_WATCH_INTERVAL_S the watch asks Slurm about the job's nodes (`node_health`); once one is lost (not
answering Slurm's pings, or DOWN) it names the node and the steps it ran (log, stderr, and through the
`on_loss` callback status.json's last_error), and requeues the job while `controller.max_restarts` allows (the
same count as the batch guard's requeues; the requeued job resumes from the last checkpoint and its
status.json lists the requeue), else the run fails with that message (`failure`). An engine restart asks
about its own nodes first (`check`): a step on a dead node would wait in srun until Slurm ends the job.
Owns that watch and the names of the nodes each step runs on. Not here: what a lost node is (`node_health`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from hpc_rl.config import RunConfig
from hpc_rl.launch.batch_guard import RESTARTS_FILE, restarts_used
from hpc_rl.launch.node_health import NodeLoss, lost_nodes, query_node_states
from hpc_rl.launch.steps import StepLauncher
from hpc_rl.controller.stopping import stop_task
from hpc_rl.launch.topology import JobTopology

log = logging.getLogger("hpc_rl.driver")

NODE_WATCH_INTERVAL_S = 2.0
"""On Slurm, how often the driver asks whether the job's nodes are alive (one `sinfo` call)."""


class NodeWatch:
    """The job's nodes as Slurm sees them (see the module docstring); does nothing in a local run."""

    def __init__(self, config: RunConfig, topology: JobTopology, launcher: StepLauncher, *, run_dir: Path,
                 local: bool, on_loss: Callable[[str], None]) -> None:
        self.config, self.topology, self.launcher = config, topology, launcher
        self.run_dir, self.local, self.on_loss = run_dir, local, on_loss
        self.lost: dict[str, NodeLoss] = {}
        """Nodes of the job Slurm reports lost, each reported once."""
        self.requeued = False
        """The driver requeued the job after losing a node (Slurm now stops this attempt)."""
        self.failure: str | None = None
        """A node was lost and the job could not be requeued: the run fails with this."""
        self._check = asyncio.Lock()
        """One check at a time: an engine restart asking about its node waits for the watch's decision."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Watch every NODE_WATCH_INTERVAL_S (Slurm only)."""
        if not self.local:
            self._task = asyncio.create_task(self._watch(), name="node-watch")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task, "the node watch", timeout_s=30.0)
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(NODE_WATCH_INTERVAL_S)
            await self.check()

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
        return None if self.local else hostnames_of(self.launcher, het_group)

    async def check(self, nodes: list[str] | None = None) -> list[NodeLoss]:
        """Ask Slurm about the job's nodes (or `nodes`); report each newly lost one (log, stderr,
        `on_loss`) and return every lost one asked about."""
        if self.local:
            return []
        asked = self.job_nodes() if nodes is None else nodes
        async with self._check:
            return await self._report(lost_nodes(await asyncio.to_thread(query_node_states, asked)))

    async def _report(self, losses: list[NodeLoss]) -> list[NodeLoss]:
        for loss in losses:
            if loss.node not in self.lost:
                self.lost[loss.node] = loss
                message = f"{loss.describe(self.steps_on(loss.node))}; {await self._after_loss()}"
                log.error(message)
                print(f"hpc_rl: {message}", file=sys.stderr, flush=True)
                self.on_loss(f"NodeLost: {message}")
                if not self.requeued:
                    self.failure = message
        return losses

    async def _after_loss(self) -> str:
        """The job lost a node: requeue it while controller.max_restarts allows (counted with the batch
        guard's requeues), else the run fails. Returns what was done, for the message."""
        if self.requeued:
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
        self.requeued = True
        return (f"requeued job {job_id} to resume from the last checkpoint on healthy nodes (restart {used + 1} "
                f"of controller.max_restarts={limit})")


def hostnames_of(launcher: StepLauncher, het_group: int) -> list[str] | None:
    """The node names of het group `het_group` (Slurm's launcher only; None when not known)."""
    hostnames = getattr(launcher, "hostnames", None)
    if hostnames is None:
        return None
    try:
        return list(hostnames(het_group))
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError):
        return None
