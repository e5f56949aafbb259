"""A trainer rank's connection to the controller: register, ask for the next command, report done.

Owns: the blocking client (trainer ranks are not asyncio programs), the Hello that carries the
rank's parallel coordinates and, on rank 0, what a loaded checkpoint says about resuming; and the
three calls of the command loop; the rank's heartbeat thread (`heartbeat`), at the interval the controller's
Welcome asks for (none when it asks for none). Rank 0 sends what a loaded checkpoint says about resuming in a
`ResumeState` right after the handshake (the Hello, read before authentication, only announces it). No Megatron here.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from hpc_rl.protocol import BlockingClient, Hello, load_secret, secret_path
from hpc_rl.protocol.messages import (Ack, CommandDone, Message, NextCommand, ResumeState, WeightGroupJoinCheck,
                                      WeightGroupJoinVerdict, WeightPlan)
from hpc_rl.training.heartbeat import HeartbeatThread

CONTROLLER_ENV = "HPC_RL_CONTROLLER"


class ControllerLink:
    """`next_command()` / `done(seq, metrics)` / `failed(seq, error)` / `send_weight_plan(plan)` /
    `join_verdict(seq)`."""

    def __init__(self, run_dir: str | Path, *, rank: int, world_size: int, info: dict[str, Any],
                 address: str | None = None, timeout_s: float | None = None,
                 resume: ResumeState | None = None) -> None:
        address = address or os.environ.get(CONTROLLER_ENV)
        if not address:
            raise RuntimeError(f"no controller address: set {CONTROLLER_ENV}=host:port (the driver does)")
        host, port = address.rsplit(":", 1)
        self.rank = rank
        secret = load_secret(secret_path(run_dir))
        # the Hello only announces resume state; the state itself follows once authenticated
        hello = Hello(role="trainer", rank=rank, world_size=world_size, host=socket.gethostname(), pid=os.getpid(),
                      info={**info, "resume_follows": True} if resume is not None else info)
        # No read timeout: a rank waits in next_command while the rollout runs, for as long as it takes.
        self.client = BlockingClient(host, int(port), secret, hello=hello, timeout=timeout_s)
        if resume is not None:
            self._expect_ack(self.client.request(resume))
        interval = float(self.client.welcome.info.get("heartbeat_interval_s") or 0)
        self.heartbeat = (HeartbeatThread(host, int(port), secret, rank=rank, interval_s=interval).start()
                          if interval > 0 else None)
        """Beats while this process runs, whatever the command loop does (see `hpc_rl.training.heartbeat`)."""

    def next_command(self) -> Message:
        return self.client.request(NextCommand(rank=self.rank))

    def done(self, seq: int, metrics: dict[str, Any] | None = None) -> None:
        self._expect_ack(self.client.request(CommandDone(rank=self.rank, seq=seq, metrics=metrics or {})))

    def failed(self, seq: int, error: str) -> None:
        self._expect_ack(self.client.request(CommandDone(rank=self.rank, seq=seq, ok=False, error=error)))

    def send_weight_plan(self, plan: WeightPlan) -> None:
        self._expect_ack(self.client.request(plan))

    def join_verdict(self, seq: int) -> str:
        """Rank 0, waiting for the engines to join the weight-update group of sync command `seq`: "" to keep
        waiting, else why to stop (the controller knows an engine will not come)."""
        reply = self.client.request(WeightGroupJoinCheck(rank=self.rank, seq=seq))
        if not isinstance(reply, WeightGroupJoinVerdict):
            raise RuntimeError(f"controller answered {reply.TYPE!r} instead of 'weight_group_join_verdict'")
        return reply.give_up

    def _expect_ack(self, reply: Message) -> None:
        if not isinstance(reply, Ack):
            raise RuntimeError(f"controller answered {reply.TYPE!r} instead of 'ack'")

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.close()
        self.client.close()
