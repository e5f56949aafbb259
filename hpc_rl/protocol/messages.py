"""The controller's message types, as versioned dataclasses: the one place callers import them from.

Re-exports the message classes, which live by concern: message_base.py (``Message``, the registry),
session_messages.py (handshake, errors, ping/status), trainer_messages.py (the trainer command loop),
weight_messages.py (weight sync), engine_messages.py (engine membership); and message_codec.py (a message <->
(a JSON header, a list of arrays)). It does not own bytes on the wire (framing.py, arrays.py) or connections
(connection.py). Importing this module registers every message class.

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

from hpc_rl.protocol.engine_messages import (  # noqa: F401  (re-exported)
    EngineJoin,
    EngineJoined,
    EngineLeave,
    EngineLeft,
)
from hpc_rl.protocol.message_base import (  # noqa: F401  (re-exported)
    REGISTRY,
    Message,
)
from hpc_rl.protocol.message_codec import (  # noqa: F401  (re-exported)
    ARRAY_REF,
    Check,
    decode_message,
    encode_message,
)
from hpc_rl.protocol.session_messages import (  # noqa: F401  (re-exported)
    Role,
    ServerHello,
    Hello,
    Welcome,
    ResumeState,
    ErrorReply,
    Ping,
    Pong,
    StatusRequest,
    StatusReply,
    Shutdown,
    Arrays,
    Ack,
)
from hpc_rl.protocol.trainer_messages import (  # noqa: F401  (re-exported)
    NextCommand,
    TrainCommand,
    EvalLossCommand,
    TrainerMemoryCommand,
    SaveCommand,
    StopCommand,
    CommandDone,
    TrainerHeartbeat,
)
from hpc_rl.protocol.weight_messages import (  # noqa: F401  (re-exported)
    SyncWeightsCommand,
    DiskWeightsCommand,
    LoraAdapterCommand,
    LoraTensorCommand,
    ColocatedSyncCommand,
    AbortWeightGroupCommand,
    WeightPlan,
    WeightGroupJoinCheck,
    WeightGroupJoinVerdict,
)
