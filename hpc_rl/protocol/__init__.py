"""hpc_rl's controller protocol: versioned message dataclasses over length-prefixed, HMAC-authenticated
frames, each MAC bound to its connection's nonce, direction and frame number (no replay, reordering or
reflection); arrays as raw bytes with dtype and shape; never Python object serialization. Nothing else
lives here.

Modules: errors (the ProtocolError family), secret (the per-job 0600 key file), framing (bytes on the
wire), arrays (array payloads), messages (THE message types), connection (async streams, request/reply),
server (authenticated asyncio server), blocking (socket client for non-async code).
"""

from hpc_rl.protocol.blocking import BlockingClient
from hpc_rl.protocol.connection import Connection, Envelope, connect, read_message, write_message
from hpc_rl.protocol.errors import (
    BadMacError,
    BadMagicError,
    FieldMismatchError,
    FrameTooLargeError,
    HandshakeError,
    MalformedFrameError,
    PeerClosedError,
    ProtocolError,
    RemoteError,
    TruncatedFrameError,
    UnknownMessageError,
    VersionMismatchError,
)
from hpc_rl.protocol.framing import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION
from hpc_rl.protocol.messages import (
    REGISTRY,
    Arrays,
    ErrorReply,
    Hello,
    Message,
    Ping,
    Pong,
    ServerHello,
    Shutdown,
    StatusReply,
    StatusRequest,
    Welcome,
    decode_message,
    encode_message,
)
from hpc_rl.protocol.secret import Secret, create_secret, load_secret, secret_path
from hpc_rl.protocol.server import Server, serve

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "REGISTRY",
    "Arrays",
    "BadMacError",
    "BadMagicError",
    "BlockingClient",
    "Connection",
    "Envelope",
    "ErrorReply",
    "FieldMismatchError",
    "FrameTooLargeError",
    "HandshakeError",
    "Hello",
    "MalformedFrameError",
    "Message",
    "PeerClosedError",
    "Ping",
    "Pong",
    "ProtocolError",
    "RemoteError",
    "Secret",
    "Server",
    "ServerHello",
    "Shutdown",
    "StatusReply",
    "StatusRequest",
    "TruncatedFrameError",
    "UnknownMessageError",
    "VersionMismatchError",
    "Welcome",
    "connect",
    "create_secret",
    "decode_message",
    "encode_message",
    "load_secret",
    "read_message",
    "secret_path",
    "serve",
    "write_message",
]
