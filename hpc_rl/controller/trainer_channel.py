"""Commands to the trainer ranks, and their completion.

Owns: one command queue per rank (a rank asks `NextCommand`, the controller answers with the next
command when there is one), sequence numbers, collecting `CommandDone` from every rank, the weight
plan that rank 0 sends during a sync (and the verdict it asks for while the engines join a new group:
`give_up_join`), and failing everything pending when a rank is lost.
Every rank runs every command in the same order: they are collective operations on the trainer side.
A command whose caller stopped waiting (cancelled: a signal, a timeout) is abandoned, not forgotten: the
ranks still run it, their CommandDone is expected and quietly absorbed, and `idle` says when they are
free again (so a stop can still save a checkpoint, and no "command N, which is not running" error).

Liveness: each rank's heartbeat thread (`hpc_rl.training.heartbeat`) beats every `heartbeat_interval_s`; any
message of a rank counts as a beat. While a command runs, a rank that has not reported it done and has been
silent for `silence_warn_s` is named once in the log and in `silent_ranks` (status: "trainer rank 0 has not
answered for 45 s: stopped or hung?"); silent for `silence_timeout_s` (`controller.trainer_command_timeout`),
the command fails with `TrainerUnresponsive` naming it. A rank that computes a long step keeps beating, so no
bound applies to how long a command may legitimately take.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpc_rl.protocol.messages import CommandDone, Message, WeightPlan


log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 5.0
"""How often each rank's heartbeat thread beats (the controller tells the ranks in its Welcome)."""
SILENCE_WARN_S = 30.0
"""A rank silent this long while a command runs is named (log, status): six beats missed, far beyond a
scheduling hiccup or a GC pause, and soon enough for someone watching `status`."""
DEFAULT_COMMAND_TIMEOUT_S = 600.0
"""`controller.trainer_command_timeout`'s default: NCCL's own watchdog (and slime's
--distributed-timeout-minutes default, 10 min) gives a hung collective as long."""


class TrainerFailed(RuntimeError):
    """A trainer rank reported an error or disconnected."""


class TrainerUnresponsive(TrainerFailed):
    """A trainer rank stopped answering (no heartbeat) while a command ran: stopped (SIGSTOP) or frozen. Its
    process is still there, so nothing exits on its own: the run must stop it."""

    process_alive = True
    """The driver does not wait for torchrun to report the rank's exit (there is none to wait for)."""


@dataclass
class _Pending:
    seq: int
    done: dict[int, CommandDone]
    future: asyncio.Future[list[CommandDone]]
    name: str = ""
    """The command's type (what the ranks are busy with)."""
    started: float = 0.0
    """time.monotonic() when it was sent."""


class TrainerChannel:
    """The controller's side of the trainer command loop."""

    def __init__(self, world_size: int, *, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 silence_warn_s: float = SILENCE_WARN_S,
                 silence_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> None:
        self.world_size = world_size
        self.heartbeat_interval_s = heartbeat_interval_s
        self.silence_warn_s = min(silence_warn_s, silence_timeout_s)
        self.silence_timeout_s = silence_timeout_s
        """`controller.trainer_command_timeout`: a rank silent this long during a command fails the run."""
        self._heard: dict[int, float] = {}
        """Rank -> time.monotonic() of its last heartbeat or message."""
        self.silent_ranks: dict[int, tuple[float, str]] = {}
        """Rank -> (when it was last heard from, the command it is silent in), once named; cleared when it speaks."""
        self._queues: dict[int, asyncio.Queue[Message]] = {r: asyncio.Queue() for r in range(world_size)}
        self._seq = 0
        self._pending: _Pending | None = None
        self._abandoned: _Pending | None = None
        """A command whose caller stopped waiting; the ranks still run it and report it done."""
        self._weight_plan: asyncio.Future[WeightPlan] | None = None
        self._join_given_up: tuple[int, str] | None = None
        """(seq of a sync command, why): rank 0 stops waiting for the engines to join its new weight-update group."""
        self.failure: TrainerFailed | None = None

    @classmethod
    def with_timeout(cls, world_size: int, timeout_s: float) -> TrainerChannel:
        """`controller.trainer_command_timeout` = `timeout_s`: named after min(SILENCE_WARN_S, half of it),
        beats at least three times within that."""
        warn = min(SILENCE_WARN_S, timeout_s / 2)
        return cls(world_size, heartbeat_interval_s=min(HEARTBEAT_INTERVAL_S, warn / 3), silence_warn_s=warn,
                   silence_timeout_s=timeout_s)

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

    def heard_from(self, rank: int) -> None:
        """Rank `rank` sent something (a heartbeat, a request): it runs."""
        self._heard[rank] = time.monotonic()
        said = self.silent_ranks.pop(rank, None)
        if said is not None:
            log.warning("trainer rank %d answers again, after %s s of silence", rank,
                        _seconds(time.monotonic() - said[0]))

    def check_liveness(self, now: float | None = None) -> None:
        """Name the ranks silent past `silence_warn_s` in the command that runs; fail it past
        `silence_timeout_s` (`TrainerUnresponsive`, naming the rank)."""
        command = self._pending or self._abandoned
        if command is None or self.failure is not None:
            return
        now = now if now is not None else time.monotonic()
        for rank in range(self.world_size):
            if rank in command.done:
                continue
            silent = now - max(self._heard.get(rank, command.started), command.started)
            if silent < self.silence_warn_s:
                continue
            if silent >= self.silence_timeout_s:
                self.fail(TrainerUnresponsive(
                    f"trainer rank {rank} has not answered for {_seconds(silent)} s during {command.name} (command "
                    f"{command.seq}): stopped (SIGSTOP) or hung; controller.trainer_command_timeout is "
                    f"{self.silence_timeout_s:g} s"))
                return
            if rank not in self.silent_ranks:
                self.silent_ranks[rank] = (now - silent, command.name)
                log.warning("%s", self._describe_silence(rank, now))

    def _describe_silence(self, rank: int, now: float) -> str:
        last, command = self.silent_ranks[rank]
        return (f"trainer rank {rank} has not answered for {_seconds(now - last)} s during {command}: stopped or "
                f"hung? (the run fails after controller.trainer_command_timeout={self.silence_timeout_s:g} s)")

    def liveness_warnings(self) -> list[str]:
        """What status says about the silent ranks now (empty while every rank answers)."""
        now = time.monotonic()
        return [self._describe_silence(rank, now) for rank in sorted(self.silent_ranks)]

    async def next_command(self, rank: int) -> Message:
        """A rank's NextCommand: wait until there is a command for it."""
        self.heard_from(rank)
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
        pending = _Pending(seq=seq, done={}, future=loop.create_future(), started=time.monotonic())
        self._pending = pending
        for rank in range(self.world_size):
            command = make_command(rank, seq)
            pending.name = type(command).__name__
            self._queues[rank].put_nowait(command)
        try:
            return await asyncio.wait_for(self._watch(pending), timeout_s)
        finally:
            self._pending = None
            if not pending.future.done():  # cancelled or timed out: the ranks still run it
                self._abandoned = pending

    async def _watch(self, pending: _Pending) -> list[CommandDone]:
        """`pending`'s result, checking the ranks' liveness while it runs (see the module docstring)."""
        every = max(0.05, min(1.0, self.heartbeat_interval_s / 2))
        while not pending.future.done():
            await asyncio.wait({pending.future}, timeout=every)
            self.check_liveness()
        return pending.future.result()

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
        self.heard_from(done.rank)
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


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def merge_metrics(done: list[CommandDone]) -> dict[str, Any]:
    """Metrics of a command: rank 0's (it logs for the trainer), plus any rank's extra keys."""
    merged: dict[str, Any] = {}
    for item in reversed(done):
        merged.update(item.metrics)
    return merged
