"""The controller's message types: the ONE module where they live, as versioned dataclasses.

Owns the message classes, the registry (type name -> class) and the conversion between a message and
(a JSON header, a list of arrays). It does not own bytes on the wire (framing.py, arrays.py) or
connections (connection.py).

Adding a message is a ~4-line affair::

    @dataclass(kw_only=True)
    class AbortRequests(Message):
        TYPE: ClassVar[str] = "abort_requests"
        request_ids: list[str]

Fields may be JSON values (None, bool, int, float, str, lists, dicts with str keys) and numpy arrays /
CPU torch tensors, also nested in lists and dicts; arrays travel as raw bytes in the frame's payload.
Set ``VERSION`` (1 unless set) to 2, 3... when a field changes meaning or is removed; both sides must then
run the same code.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal

import numpy as np

from hpc_rl.protocol.arrays import is_array
from hpc_rl.protocol.errors import FieldMismatchError, MalformedFrameError, UnknownMessageError

ARRAY_REF = "$a"
"""Key of the placeholder ``{"$a": index}`` that stands for an array inside the JSON fields."""

REGISTRY: dict[str, type[Message]] = {}
"""Every message class, by its ``TYPE``."""


@dataclass(kw_only=True)
class Message:
    """Base of all messages; subclasses set ``TYPE`` (unique wire name) and ``VERSION``."""

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    """Set in a subclass only when bumped."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.TYPE:
            raise TypeError(f"message class {cls.__name__} must set TYPE")
        if cls.TYPE in REGISTRY and REGISTRY[cls.TYPE].__qualname__ != cls.__qualname__:
            raise TypeError(
                f"message TYPE {cls.TYPE!r} of {cls.__name__} is already used by {REGISTRY[cls.TYPE].__name__}"
            )
        REGISTRY[cls.TYPE] = cls


# --- the messages ---------------------------------------------------------------------------------------

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


# --- the run: controller <-> trainer ranks ---------------------------------------------------------------


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
class SyncWeightsCommand(Message):
    """Send the current weights to the engines as `weight_version` (rank 0 broadcasts)."""

    TYPE: ClassVar[str] = "sync_weights"
    seq: int
    weight_version: int
    new_group: bool
    world_size: int
    group_name: str
    backend: str
    bucket_bytes: int


@dataclass(kw_only=True)
class DiskWeightsCommand(Message):
    """Write the current weights as an HF directory at `path` (every rank takes part; slime's
    --update-weight-transport disk): the engines then load it with /update_weights_from_disk."""

    TYPE: ClassVar[str] = "disk_weights"
    seq: int
    weight_version: int
    path: str
    engine_urls: list[str] = field(default_factory=list)
    """The engines that will read it (handed to the post-write hook, slime's rollout_engines)."""


@dataclass(kw_only=True)
class LoraAdapterCommand(Message):
    """Write the actor's LoRA adapter (only the adapter; issue 33) as a PEFT directory at `path` (every rank takes
    part: the TP shards are gathered): the engines then load it with /load_lora_adapter."""

    TYPE: ClassVar[str] = "lora_adapter"
    seq: int
    weight_version: int
    path: str


@dataclass(kw_only=True)
class LoraTensorCommand(Message):
    """Send the actor's LoRA adapter (only the adapter; issue 33) to the engine on each rank's GPU through SGLang's
    /load_lora_adapter_from_tensors as `lora_name` (every rank takes part: the TP shards are gathered; the rank on
    each engine's TP rank 0 posts it)."""

    TYPE: ClassVar[str] = "lora_tensor"
    seq: int
    weight_version: int
    lora_name: str
    engine_urls: list[str]
    """By engine index; "" for an engine that is down or already holds `lora_name`."""
    rank_engines: list[list[int]]
    """Per trainer rank: [engine index, engine TP rank] of the engine on its GPU (as ColocatedSyncCommand's)."""


@dataclass(kw_only=True)
class ColocatedSyncCommand(Message):
    """Colocated mode: every rank sends the current weights to the engine on its own GPU, per bucket,
    through `/update_weights_from_tensor` (no weight-update group; the controller opens the session)."""

    TYPE: ClassVar[str] = "colocated_sync"
    VERSION: ClassVar[int] = 2
    """2: ranks are paired with engines by the GPU they share (`rank_engines`), not by rank arithmetic."""
    seq: int
    weight_version: int
    engine_urls: list[str]
    """By engine index; "" for an engine that is down (its ranks still take part in the TP gathers)."""
    rank_engines: list[list[int]]
    """Per trainer rank: [engine index, engine TP rank] of the engine whose TP rank runs on the rank's GPU
    (paired by device identity, `weights.device_identity.pair_ranks_with_engines`)."""
    bucket_bytes: int


@dataclass(kw_only=True)
class AbortWeightGroupCommand(Message):
    """An engine broke a weight sync: rank 0 aborts the weight-update group without waiting for its pending
    broadcasts (on NCCL they never complete); the next sync builds a new group."""

    TYPE: ClassVar[str] = "abort_weight_group"
    seq: int
    reason: str = ""


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
class WeightPlan(Message):
    """Trainer rank 0 -> controller during a sync: where to meet and the buckets it will broadcast."""

    TYPE: ClassVar[str] = "weight_plan"
    weight_version: int
    master_address: str
    master_port: int
    buckets: list[dict[str, Any]]
    """Per bucket: names, dtypes, shapes (lists, in broadcast order) and num_bytes."""
    load_format: str | None = None


@dataclass(kw_only=True)
class WeightGroupJoinCheck(Message):
    """Trainer rank 0 -> controller, every half second while it waits for the engines to join a new weight-update
    group (sync command `seq`): should it go on waiting? (An engine that dies before joining never comes; only the
    controller knows, from the engine's failed init call.)"""

    TYPE: ClassVar[str] = "weight_group_join_check"
    rank: int
    seq: int


@dataclass(kw_only=True)
class WeightGroupJoinVerdict(Message):
    """The controller's answer to a WeightGroupJoinCheck: "" (keep waiting) or why rank 0 stops waiting (it then
    ends the sync command without broadcasting; the controller rebuilds the group without the lost engine)."""

    TYPE: ClassVar[str] = "weight_group_join_verdict"
    give_up: str = ""


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


# --- engine jobs: an engine agent <-> the run's controller (hpc_rl.engines.engine_agent) ----------------------

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


@dataclass(kw_only=True)
class Ack(Message):
    """A request was accepted (nothing else to say)."""

    TYPE: ClassVar[str] = "ack"


# --- encoding -------------------------------------------------------------------------------------------


def _encode_value(value: Any, arrays: list[Any], where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if is_array(value):
        arrays.append(value)
        return {ARRAY_REF: len(arrays) - 1}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_encode_value(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if ARRAY_REF in value:
            raise FieldMismatchError(f"{where}: dict key {ARRAY_REF!r} is reserved for array references")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise FieldMismatchError(f"{where}: dict keys must be str, got {k!r}")
            out[k] = _encode_value(v, arrays, f"{where}[{k!r}]")
        return out
    raise FieldMismatchError(
        f"{where}: cannot send a {type(value).__name__}; allowed are None, bool, int, float, str, lists, "
        "dicts with str keys, numpy arrays and CPU torch tensors"
    )


def _decode_value(value: Any, arrays: list[Any], where: str) -> Any:
    if isinstance(value, list):
        return [_decode_value(v, arrays, where) for v in value]
    if isinstance(value, dict):
        if ARRAY_REF in value:
            index = value[ARRAY_REF]
            if len(value) != 1 or not isinstance(index, int) or not 0 <= index < len(arrays):
                raise MalformedFrameError(
                    f"{where}: bad array reference {value!r} ({len(arrays)} arrays sent)"
                )
            return arrays[index]
        return {k: _decode_value(v, arrays, where) for k, v in value.items()}
    return value


Check = typing.Callable[[Any], "str | None"]
"""Why a value does not fit a field's annotation (outer types and container elements), or None if it fits."""


def _fits(value: Any) -> None:
    return None


def _plain(test: typing.Callable[[Any], bool], expected: str) -> Check:
    return lambda value: None if test(value) else f"expected {expected}, got {type(value).__name__}"


def _number(kind: type) -> typing.Callable[[Any], bool]:
    return lambda value: isinstance(value, kind) and not isinstance(value, bool)


_PLAIN: dict[Any, Check] = {
    type(None): _plain(lambda value: value is None, "None"),
    np.ndarray: _plain(is_array, "an array"),
    float: _plain(_number((int, float)), "float"),  # type: ignore[arg-type]
    int: _plain(_number(int), "int"),
    bool: _plain(lambda value: isinstance(value, bool), "bool"),
    str: _plain(lambda value: isinstance(value, str), "str"),
}


def _check_of(hint: Any) -> Check:
    """The check of one annotation, built once per message class (a message is checked on both ends)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _PLAIN:
        return _PLAIN[hint]
    if origin is typing.Union or origin is types.UnionType:
        options = [_check_of(option) for option in args]
        return lambda value: None if any(c(value) is None for c in options) else f"{value!r:.80} is none of {hint}"
    if origin is Literal:
        return lambda value: None if value in args else f"{value!r:.80} is not one of {args}"
    if origin in (list, tuple) or hint in (list, tuple):
        item = _check_of(args[0]) if len(args) == 1 or (origin is tuple and args[1:] == (Ellipsis,)) else _fits

        def check_list(value: Any) -> str | None:
            if not isinstance(value, (list, tuple)):
                return f"expected a list, got {type(value).__name__}"
            errors = (f"item {i}: {e}" for i, v in enumerate(value) if (e := item(v)) is not None)
            return None if item is _fits else next(errors, None)

        return check_list
    if origin is dict or hint is dict:
        entry = _check_of(args[1]) if len(args) == 2 else _fits

        def check_dict(value: Any) -> str | None:
            if not isinstance(value, dict):
                return f"expected a dict, got {type(value).__name__}"
            errors = (f"key {k!r}: {e}" for k, v in value.items() if (e := entry(v)) is not None)
            return None if entry is _fits else next(errors, None)

        return check_dict
    return _fits  # Any, type variables, other annotations (custom classes): not checked


_CHECKS: dict[type, dict[str, Check]] = {}


def _check_fields(cls: type[Message], values: dict[str, Any]) -> None:
    checks = _CHECKS.get(cls)
    if checks is None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001  (an unresolvable annotation: skip type checks for the class)
            hints = {}
        checks = _CHECKS[cls] = {f.name: _check_of(hints[f.name]) for f in fields(cls) if f.name in hints}
    for name, value in values.items():
        if name in checks and (err := checks[name](value)) is not None:
            raise FieldMismatchError(f"{cls.__name__}.{name}: {err}")


def encode_message(msg: Message) -> tuple[dict[str, Any], list[Any]]:
    """(header dict with type, version and JSON fields; arrays referenced from the fields, in order)."""
    cls = type(msg)
    if REGISTRY.get(cls.TYPE) is not cls:
        raise UnknownMessageError(f"{cls.__name__} is not a registered message class")
    values = {f.name: getattr(msg, f.name) for f in fields(msg)}
    _check_fields(cls, values)
    arrays: list[Any] = []
    encoded = {name: _encode_value(v, arrays, f"{cls.__name__}.{name}") for name, v in values.items()}
    return {"type": cls.TYPE, "v": cls.VERSION, "fields": encoded}, arrays


def decode_message(header: dict[str, Any], arrays: list[Any]) -> Message:
    """The message a header (and its decoded arrays) describes; clear errors for unknown or bad ones."""
    type_name, version, raw = header.get("type"), header.get("v"), header.get("fields")
    cls = REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise UnknownMessageError(
            f"unknown message type {type_name!r}; this side knows {', '.join(sorted(REGISTRY))} "
            "(are both sides running the same hpc_rl version?)"
        )
    if version != cls.VERSION:
        raise UnknownMessageError(
            f"message {type_name!r} version mismatch: the peer sent v{version}, this side speaks v{cls.VERSION}"
        )
    if not isinstance(raw, dict):
        raise MalformedFrameError(f"message {type_name!r}: 'fields' must be an object")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    missing = sorted(
        n for n, f in known.items() if n not in raw and f.default is MISSING and f.default_factory is MISSING
    )
    if unknown or missing:
        raise FieldMismatchError(
            f"message {type_name!r} v{version} does not match {cls.__name__}: "
            f"unknown fields {unknown}, missing fields {missing}"
        )
    values = {n: _decode_value(v, arrays, f"{cls.__name__}.{n}") for n, v in raw.items()}
    _check_fields(cls, values)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:  # a __post_init__ invariant of the class
        raise FieldMismatchError(f"message {type_name!r}: {e}") from None
