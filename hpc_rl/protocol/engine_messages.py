"""Engine membership messages: an engine job's agent (hpc_rl.engines.engine_agent) <-> the run's controller,
an engine joining the run and leaving it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hpc_rl.protocol.message_base import Message


@dataclass(kw_only=True)
class EngineJoin(Message):
    """An engine of an engine job (`python -m hpc_rl.submit ... --engines-for RUN_DIR`) answers /health at `url`:
    the controller adds it (it serves once it holds the current weights). Sent again to every new controller."""

    TYPE: ClassVar[str] = "engine_join"
    url: str
    tp_size: int = 1
    job_id: str = ""
    """The engine job's Slurm job id ("local-<pid>" outside Slurm)."""
    name: str = ""
    """The agent's own name for it (`<job id>/<engine on the node>` on `<node>`), for logs and status."""


@dataclass(kw_only=True)
class EngineJoined(Message):
    """The controller's answer to an EngineJoin: the engine's index in this run (its name in logs and status)."""

    TYPE: ClassVar[str] = "engine_joined"
    engine_index: int
    weight_version: int
    """The version the engine gets before it serves."""


@dataclass(kw_only=True)
class EngineLeave(Message):
    """The agent's engine leaves (the job's time limit, preemption, scancel): drain it, then answer."""

    TYPE: ClassVar[str] = "engine_leave"
    engine_index: int
    reason: str = ""


@dataclass(kw_only=True)
class EngineLeft(Message):
    """The controller's answer to an EngineLeave: the engine is off the router, its requests aborted and back with
    the rollout (`requeued`), after `drain_s` seconds; the agent may stop it now."""

    TYPE: ClassVar[str] = "engine_left"
    requeued: int = 0
    drain_s: float = 0.0
