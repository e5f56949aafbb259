"""Whether the nodes of this job are alive, as Slurm sees them: `lost_nodes` and `NodeLoss`.

Owns: asking `sinfo` about a set of nodes, deciding which of them are lost (Slurm marks a node whose
slurmd stopped answering `*`, "not responding", after a failed ping, then DOWN after `SlurmdTimeout`;
DRAIN/FAIL states are lost too), and the sentence that names a lost node with the job steps it hosted.
It does not decide what happens to the job: the driver (`hpc_rl.launch.node_watch`) watches with this
module, says which node died and what ran there (log, stderr, status.json), and requeues the job
itself while `controller.max_restarts` allows (else the run fails), before Slurm's own verdict
(NODE_FAIL once the node is DOWN, which requeues only where `JobRequeue=1`) can end it for good.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

LOST_STATES = ("down", "drain", "fail", "future", "unknown", "power")
"""State prefixes (sinfo %T, lower case) of a node that can no longer run this job's steps."""


@dataclass(frozen=True)
class NodeLoss:
    """One node of the job that Slurm reports as lost."""

    node: str
    state: str
    """sinfo's long state, e.g. 'down*' or 'mixed*' (`*`: the node does not answer Slurm's pings)."""
    reason: str
    """Slurm's reason, e.g. 'Not responding' ('' when it gave none)."""

    def describe(self, steps: list[str]) -> str:
        hosted = ", ".join(steps) if steps else "no step of this run"
        why = f", reason: {self.reason}" if self.reason else ""
        return f"node {self.node} is lost (Slurm state {self.state}{why}); it ran {hosted}"


def is_lost(state: str) -> bool:
    """A node that does not answer (`*`) or is down/draining/failed."""
    state = state.strip().lower()
    return state.endswith("*") or state.rstrip("*~#!%$@^-").startswith(LOST_STATES)


def parse_sinfo(text: str) -> dict[str, tuple[str, str]]:
    """`sinfo -h -N -o '%N|%T|%E'` output -> {node: (state, reason)} (a node listed per partition: once)."""
    nodes: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and parts[0]:
            reason = parts[2].strip()
            nodes.setdefault(parts[0], (parts[1].strip(), "" if reason == "none" else reason))
    return nodes


def lost_nodes(states: Mapping[str, tuple[str, str]]) -> list[NodeLoss]:
    return [NodeLoss(node, state, reason) for node, (state, reason) in sorted(states.items()) if is_lost(state)]


def query_node_states(nodes: list[str], *, timeout_s: float = 20.0) -> dict[str, tuple[str, str]]:
    """Slurm's state of each node ({} when sinfo cannot answer: then nothing is reported lost)."""
    if not nodes:
        return {}
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%T|%E"], check=False,
                             capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_sinfo(out.stdout) if out.returncode == 0 else {}
