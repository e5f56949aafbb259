"""Session messages: the handshake (ServerHello, Hello, Welcome, ResumeState), errors, ping/status, shutdown,
plain acks and generic named arrays; what any connection to the controller may carry, whatever its role.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from hpc_rl.protocol.message_base import Message


Role = Literal["trainer", "engine", "status", "launcher", "trainer_heartbeat"]
"""trainer_heartbeat: a trainer rank's heartbeat thread, on a connection of its own (`TrainerHeartbeat`)."""


@dataclass(kw_only=True)
class ServerHello(Message):
    """The server's first frame on every connection: the fresh nonce every later frame's MAC is bound to
    (see framing.py)."""

    TYPE: ClassVar[str] = "server_hello"
    nonce: str
    """32 random bytes, hex (checked by the client: connection.nonce_of_server_hello)."""


@dataclass(kw_only=True)
class Hello(Message):
    """The client's first frame on every connection (after the server's hello): who is calling."""

    TYPE: ClassVar[str] = "hello"
    role: Role
    rank: int = 0
    world_size: int = 1
    host: str = ""
    pid: int = 0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Welcome(Message):
    """The server's answer to a valid Hello."""

    TYPE: ClassVar[str] = "welcome"
    connection_id: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class ResumeState(Message):
    """Trainer rank 0 -> controller, right after its Welcome, when it loaded a checkpoint: where the run
    resumes. Never in the Hello: a Hello is read before its MAC is checked, so it stays small
    (framing.HANDSHAKE_MAX_FRAME_BYTES); this rides an authenticated connection like any request.
    The Hello announces it (`info["resume_follows"]`), so the controller waits for it before resuming."""

    TYPE: ClassVar[str] = "resume_state"
    rank: int
    rollout_id: int
    """The last rollout the loaded checkpoint holds."""
    controller_state: dict[str, Any] = field(default_factory=dict)
    """What the controller saved with it (`RunLoop.controller_state`)."""


@dataclass(kw_only=True)
class ErrorReply(Message):
    """A request failed (or the connection is being closed for a protocol error): why."""

    TYPE: ClassVar[str] = "error"
    message: str


@dataclass(kw_only=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"
    payload: str = ""


@dataclass(kw_only=True)
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    payload: str = ""


@dataclass(kw_only=True)
class StatusRequest(Message):
    TYPE: ClassVar[str] = "status_request"


@dataclass(kw_only=True)
class StatusReply(Message):
    TYPE: ClassVar[str] = "status_reply"
    status: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Shutdown(Message):
    """Ask the peer to stop (the controller to its trainers/engines, or an operator to the controller)."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""


@dataclass(kw_only=True)
class Arrays(Message):
    """Generic named arrays plus JSON metadata (tests, benchmarks, ad-hoc tensors)."""

    TYPE: ClassVar[str] = "arrays"
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Ack(Message):
    """A request was accepted (nothing else to say)."""

    TYPE: ClassVar[str] = "ack"
