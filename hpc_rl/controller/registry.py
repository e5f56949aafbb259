"""Who is in the job: trainer ranks and engines, and the readiness barrier.

Owns: the live set of trainer ranks (from their Hello) and engines (URL, TP size, weight-group rank
offset, health state), `wait_ready(timeout)` that names exactly who is missing when it times out,
and the `EngineDirectory` view the rollout client reads (engines that are up and serving).
Does not own: talking to them (trainer_channel, engine_admin) or restarting them (the driver).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any


class RegistrationTimeout(RuntimeError):
    """Not everyone registered in time; the message lists who is missing."""


class EngineState(str, enum.Enum):
    STARTING = "starting"
    """Started; not yet serving (waiting for current weights before it joins the router)."""
    SERVING = "serving"
    """Behind the router, receiving requests."""
    FAILED = "failed"
    """Health check failed or the process died; removed from the router."""
    LEFT = "left"
    """An engine of an engine job left (its job ends): drained, off the router, never restarted."""


@dataclass(kw_only=True)
class TrainerInfo:
    rank: int
    world_size: int
    host: str
    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class EngineInfo:
    engine_index: int
    url: str
    tp_size: int = 1
    state: EngineState = EngineState.STARTING
    restarts: int = 0
    last_error: str = ""
    incarnation: int = 0
    """Which registration this is (set by the registry, unique in the run): a restarted engine reuses
    its index and URL, so only this tells the new process from the one the weight group was built with."""
    devices: list[str] = field(default_factory=list)
    """The GPU of each TP rank, as its step read it back from Slurm (`<node>/gpu<id>`; hpc_rl.engines.gpu_step)."""
    job_id: str = ""
    """The engine job it came from (`EngineJoin`); "" for an engine of the run's own job."""


class Registry:
    """Trainer ranks and engines of the run."""

    def __init__(self, *, trainer_world_size: int, num_engines: int) -> None:
        self.trainer_world_size = trainer_world_size
        self.num_engines = num_engines
        self.trainers: dict[int, TrainerInfo] = {}
        self.engines: dict[int, EngineInfo] = {}
        self._changed = asyncio.Event()
        self._registrations = 0
        self._serving_urls: tuple[str, ...] | None = None
        """engine_urls() cache: the rollout client reads it per request (O(N) to rebuild at 1,024 engines)."""
        self.changes = 0
        """Counts every change of what `snapshot` shows (status.json rebuilds its components only after one)."""

    def add_trainer(self, trainer: TrainerInfo) -> None:
        if trainer.world_size != self.trainer_world_size:
            raise ValueError(f"trainer rank {trainer.rank} reports world size {trainer.world_size}, "
                             f"the config says {self.trainer_world_size}")
        if trainer.rank in self.trainers:
            raise ValueError(f"trainer rank {trainer.rank} registered twice (pid {self.trainers[trainer.rank].pid} "
                             f"and {trainer.pid})")
        self.trainers[trainer.rank] = trainer
        self.changed()

    def remove_trainer(self, rank: int) -> None:
        self.trainers.pop(rank, None)
        self.changed()

    def add_engine(self, engine: EngineInfo) -> None:
        """Register (or re-register, after a restart) an engine; it gets a new `incarnation`."""
        self._registrations += 1
        engine.incarnation = self._registrations
        self.engines[engine.engine_index] = engine
        self._serving_urls = None
        self.changed()

    def set_engine_state(self, engine_index: int, state: EngineState, error: str = "") -> None:
        engine = self.engines[engine_index]
        engine.state = state
        self._serving_urls = None
        if error:
            engine.last_error = error
        self.changed()

    def changed(self) -> None:
        """A component registered, left or changed (callers that change an `EngineInfo` field in place call it)."""
        self.changes += 1
        self._changed.set()

    def serving_engines(self) -> list[EngineInfo]:
        return [e for _, e in sorted(self.engines.items()) if e.state == EngineState.SERVING]

    def live_engines(self) -> list[EngineInfo]:
        """Engines that are up (serving or waiting for weights), in index order."""
        return [e for _, e in sorted(self.engines.items()) if e.state not in (EngineState.FAILED, EngineState.LEFT)]

    def engine_urls(self) -> tuple[str, ...]:
        """EngineDirectory: base URLs of the engines serving now, as one tuple kept until a change (so a reader can
        tell by identity that nothing changed: the rollout client picks an engine per request)."""
        if self._serving_urls is None:
            self._serving_urls = tuple(e.url for e in self.serving_engines())
        return self._serving_urls

    def missing(self) -> list[str]:
        missing = [f"trainer rank {r}" for r in range(self.trainer_world_size) if r not in self.trainers]
        missing += [f"engine {i}" for i in range(self.num_engines) if i not in self.engines]
        return missing

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every trainer rank and engine registered; RegistrationTimeout names who is missing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.missing():
            self._changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise RegistrationTimeout(
                    f"not registered after {timeout_s:.0f} s: {', '.join(self.missing())} "
                    f"(see their logs in the run dir's logs/)"
                )
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                continue

    def snapshot(self) -> dict[str, Any]:
        return {
            "trainers": {r: {"host": t.host, "pid": t.pid, "device": t.info.get("device")}
                         for r, t in sorted(self.trainers.items())},
            "engines": {i: {"url": e.url, "state": e.state.value, "restarts": e.restarts, "last_error": e.last_error,
                            "devices": e.devices, **({"job_id": e.job_id} if e.job_id else {})} for i, e in sorted(self.engines.items())},
        }
