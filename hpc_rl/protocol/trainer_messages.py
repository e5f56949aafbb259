"""The run's command loop between the controller and the trainer ranks: asking for the next command, the
train / eval / save / stop / memory commands, their completion and the ranks' heartbeat. Weight-sync
commands are weight_messages.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from hpc_rl.protocol.message_base import Message


@dataclass(kw_only=True)
class NextCommand(Message):
    """Trainer rank -> controller: "what do I do next?"; answered by one of the commands below."""

    TYPE: ClassVar[str] = "next_command"
    rank: int


@dataclass(kw_only=True)
class TrainCommand(Message):
    """Train on this rank's share of rollout `rollout_id` (flat arrays, see controller.train_batches)."""

    TYPE: ClassVar[str] = "train"
    seq: int
    rollout_id: int
    batch: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class EvalLossCommand(Message):
    """Forward only, no update: this rank's share of a held-out set (flat arrays as a TrainCommand's); the done
    message carries its loss and greedy accuracy over the assistant tokens (SFT's eval)."""

    TYPE: ClassVar[str] = "eval_loss"
    seq: int
    batch: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class TrainerMemoryCommand(Message):
    """Colocated mode: `offload` trainer state off the device (the engines need it) or `onload` it back."""

    TYPE: ClassVar[str] = "trainer_memory"
    seq: int
    action: str
    """offload | onload"""
    tags: list[str]
    """weights, grads, optimizer (hpc_rl.training.offload)."""


@dataclass(kw_only=True)
class SaveCommand(Message):
    """Save a checkpoint after rollout `rollout_id`, with the controller's state inside it."""

    TYPE: ClassVar[str] = "save"
    seq: int
    rollout_id: int
    controller_state: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class StopCommand(Message):
    """Leave the command loop and exit cleanly."""

    TYPE: ClassVar[str] = "stop"
    seq: int
    reason: str = ""


@dataclass(kw_only=True)
class CommandDone(Message):
    """Trainer rank -> controller: a command finished (or failed, with the error)."""

    TYPE: ClassVar[str] = "command_done"
    rank: int
    seq: int
    ok: bool = True
    error: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class TrainerHeartbeat(Message):
    """Trainer rank -> controller, from a thread of the rank on a connection of its own, every few seconds: the
    process runs (a SIGSTOPped rank stops every thread; a long step computing does not stop this one)."""

    TYPE: ClassVar[str] = "trainer_heartbeat"
    rank: int
