"""Commands to the trainer ranks, and their completion.

Owns: one command queue per rank (a rank asks `NextCommand`, the controller answers with the next
command when there is one), sequence numbers, collecting `CommandDone` from every rank, the weight
plan that rank 0 sends during a sync (and the verdict it asks for while the engines join a new group:
`give_up_join`), and failing everything pending when a rank is lost.
Every rank runs every command in the same order: they are collective operations on the trainer side.
A command whose caller stopped waiting (cancelled: a signal, a timeout) is abandoned, not forgotten: the
ranks still run it, their CommandDone is expected and quietly absorbed, and `idle` says when they are
free again (so a stop can still save a checkpoint, and no "command N, which is not running" error).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpc_rl.protocol.messages import CommandDone, Message, WeightPlan


class TrainerFailed(RuntimeError):
    """A trainer rank reported an error or disconnected."""


@dataclass
class _Pending:
    seq: int
    done: dict[int, CommandDone]
    future: asyncio.Future[list[CommandDone]]
    name: str = ""
    """The command's type (what the ranks are busy with)."""


class TrainerChannel:
    """The controller's side of the trainer command loop."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._queues: dict[int, asyncio.Queue[Message]] = {r: asyncio.Queue() for r in range(world_size)}
        self._seq = 0
        self._pending: _Pending | None = None
        self._abandoned: _Pending | None = None
        """A command whose caller stopped waiting; the ranks still run it and report it done."""
        self._weight_plan: asyncio.Future[WeightPlan] | None = None
        self._join_given_up: tuple[int, str] | None = None
        """(seq of a sync command, why): rank 0 stops waiting for the engines to join its new weight-update group."""
        self.failure: TrainerFailed | None = None

    @property
    def idle(self) -> bool:
        """No command is running on the ranks (neither awaited nor abandoned)."""
        return self._pending is None and self._abandoned is None

    @property
    def running(self) -> str:
        """The type of the command the ranks run ("" when idle): what a stop that could not wait was cut at."""
        command = self._pending or self._abandoned
        return command.name if command is not None else ""

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def next_command(self, rank: int) -> Message:
        """A rank's NextCommand: wait until there is a command for it."""
        if self.failure is not None:
            raise self.failure
        return await self._queues[rank].get()

    async def run(self, make_command: Callable[[int, int], Message], *,
                  timeout_s: float | None = None) -> list[CommandDone]:
        """Send `make_command(rank, seq)` to every rank; wait until all report done (ranks in order)."""
        if self.failure is not None:
            raise self.failure
        if self._pending is not None:
            raise RuntimeError("a trainer command is already running")
        seq = self.next_seq()
        loop = asyncio.get_running_loop()
        pending = _Pending(seq=seq, done={}, future=loop.create_future())
        self._pending = pending
        for rank in range(self.world_size):
            command = make_command(rank, seq)
            pending.name = type(command).__name__
            self._queues[rank].put_nowait(command)
        try:
            return await asyncio.wait_for(asyncio.shield(pending.future), timeout_s)
        finally:
            self._pending = None
            if not pending.future.done():  # cancelled or timed out: the ranks still run it
                self._abandoned = pending

    def expect_weight_plan(self) -> asyncio.Future[WeightPlan]:
        """Call before sending a sync command: the future gets the plan rank 0 sends during it."""
        self._weight_plan = asyncio.get_running_loop().create_future()
        return self._weight_plan

    def on_weight_plan(self, plan: WeightPlan) -> None:
        if self._weight_plan is None or self._weight_plan.done():
            raise TrainerFailed("trainer sent a weight plan outside a sync")
        self._weight_plan.set_result(plan)

    def give_up_join(self, reason: str) -> None:
        """The running sync command's new weight-update group will not be complete (an engine died or failed
        before joining): rank 0's next WeightGroupJoinCheck tells it to stop waiting (see `join_verdict`)."""
        if self._pending is not None:
            self._join_given_up = (self._pending.seq, reason)

    def join_verdict(self, seq: int) -> str:
        """What rank 0 asking about sync command `seq` is told: "" (keep waiting) or why it stops waiting."""
        given_up = self._join_given_up
        return given_up[1] if given_up is not None and given_up[0] == seq else ""

    def on_done(self, done: CommandDone) -> None:
        abandoned = self._abandoned
        if abandoned is not None and done.seq == abandoned.seq:
            abandoned.done[done.rank] = done
            if len(abandoned.done) == self.world_size or not done.ok:
                self._abandoned = None  # a failed rank runs nothing more of it
            return
        pending = self._pending
        if pending is None or done.seq != pending.seq:
            raise TrainerFailed(f"trainer rank {done.rank} finished command {done.seq}, which is not running")
        if not done.ok:
            self.fail(TrainerFailed(f"trainer rank {done.rank} failed command {done.seq}: {done.error}"))
            return
        pending.done[done.rank] = done
        if len(pending.done) == self.world_size and not pending.future.done():
            pending.future.set_result([pending.done[r] for r in range(self.world_size)])

    def fail(self, error: TrainerFailed) -> None:
        """A rank is gone or broken: everything waiting on the trainer fails with `error`."""
        if self.failure is None:
            self.failure = error
        for future in (self._pending.future if self._pending else None, self._weight_plan):
            if future is not None and not future.done():
                future.set_exception(error)


def merge_metrics(done: list[CommandDone]) -> dict[str, Any]:
    """Metrics of a command: rank 0's (it logs for the trainer), plus any rank's extra keys."""
    merged: dict[str, Any] = {}
    for item in reversed(done):
        merged.update(item.metrics)
    return merged
