"""Which ports a run's servers use: `PortPlan`, and the checks around a port that is taken.

Owns: the port of the controller, the router (and its metrics), torchrun's rendezvous store and every engine
(multi-node engines: each node-rank's, and node-rank 0's distributed init): locally free ones; on Slurm the
topology's ports shifted by the job's slot, those found in use on the driver's node replaced before anything
binds. Also whether a port is in use, and whether a server's log says it could not bind (the servers'
starts retry on a free port then: `servers`). Not here: the topology's base ports (`topology`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from hpc_rl.launch.topology import DIST_INIT_PORT_OFFSET, EnginePlacement, JobTopology, node_rank_port
from hpc_rl.process.child_process import free_port, planned_port

log = logging.getLogger("hpc_rl.driver")

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
        they run on `host`: a remote node's ports cannot be probed from here; see Servers.start_engine)."""

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


def bind_failed(log_text: str) -> bool:
    """A server's log says its port was taken (Python, aiohttp, Rust and SGLang wordings)."""
    text = log_text.lower()
    return "address already in use" in text or "errno 98" in text or "eaddrinuse" in text


def log_since(path: Path, offset: int) -> str:
    """What a step wrote to its (appended) log since `offset`: the output of this attempt only."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except OSError:
        return ""
