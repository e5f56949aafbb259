"""hpc_rl's controller protocol: versioned message dataclasses over length-prefixed, HMAC-authenticated
frames, each MAC bound to its connection's nonce, direction and frame number (no replay, reordering or
reflection); arrays as raw bytes with dtype and shape; never Python object serialization. Nothing else
lives here.

Modules: errors (the ProtocolError family), secret (the per-job 0600 key file), framing (bytes on the
wire), arrays (array payloads), messages (THE message types), connection (async streams, request/reply),
server (authenticated asyncio server), blocking (socket client for non-async code), http_client (the
one HTTP/1.1 client for engines and the router). Re-exported here: what a process needs to open or
serve a connection; message types and errors are imported from their modules.
"""

from hpc_rl.protocol.blocking import BlockingClient
from hpc_rl.protocol.connection import Connection, Envelope, connect
from hpc_rl.protocol.errors import ProtocolError
from hpc_rl.protocol.messages import Hello, Message
from hpc_rl.protocol.secret import Secret, create_secret, load_secret, secret_path
from hpc_rl.protocol.server import Server, serve

__all__ = ["BlockingClient", "Connection", "Envelope", "Hello", "Message", "ProtocolError", "Secret", "Server",
           "connect", "create_secret", "load_secret", "secret_path", "serve"]
