"""A blocking client over a plain socket, for code that is not async (the torchrun trainer ranks).

Owns the synchronous twin of ``connect``/``Connection.request``: handshake on construction (read the
server hello, bind both frame counters to its nonce, Hello -> Welcome), then ``request(msg) -> reply``;
messages the server pushes unasked wait in ``inbox`` for ``recv()``. Thread-safe: one request at a time
per client.
"""

from __future__ import annotations

import collections
import socket
import threading
from typing import NoReturn, Self

from hpc_rl.protocol.connection import (
    Envelope,
    default_hello,
    envelope_from_frame,
    message_frame,
    nonce_of_server_hello,
)
from hpc_rl.protocol.errors import HandshakeError, PeerClosedError, ProtocolError, RemoteError
from hpc_rl.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    HANDSHAKE_MAX_FRAME_BYTES,
    FrameCounter,
    frame_chunks,
    recv_frame,
    session_counters,
)
from hpc_rl.protocol.messages import ErrorReply, Hello, Message, Welcome
from hpc_rl.protocol.secret import Secret


class BlockingClient:
    """``BlockingClient(host, port, secret).request(Ping()) -> Pong``; use as a context manager."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: Secret,
        *,
        hello: Hello | None = None,
        timeout: float | None = 60.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.peer = f"{host}:{port}"
        self.secret, self.max_frame_bytes = secret, max_frame_bytes
        self.inbox: collections.deque[Envelope] = collections.deque()
        self._lock = threading.Lock()
        self._next_id = 1
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            try:
                server_hello = self._receive(FrameCounter.server_hello(), HANDSHAKE_MAX_FRAME_BYTES)
            except TimeoutError:
                raise HandshakeError(f"no server hello from {self.peer} within {timeout} s") from None
            self.nonce = nonce_of_server_hello(server_hello, self.peer)
            self._outgoing, self._incoming = session_counters(self.nonce, server=False)
            reply = self.request(hello or default_hello("trainer"))
        except TimeoutError:
            self.close()
            raise HandshakeError(f"no Welcome from {self.peer} within {timeout} s") from None
        except BaseException:
            self.close()
            raise
        if not isinstance(reply, Welcome):
            self.close()
            raise HandshakeError(f"{self.peer} answered Hello with {reply.TYPE!r}, not 'welcome'")
        self.welcome: Welcome = reply

    def send(self, msg: Message, *, reply_to: int | None = None) -> int:
        """Send without waiting; return the message id."""
        with self._lock:
            return self._send(msg, reply_to)

    def _send(self, msg: Message, reply_to: int | None) -> int:
        msg_id = self._next_id
        self._next_id += 1
        header, parts = message_frame(msg, id=msg_id, reply_to=reply_to)
        for chunk in frame_chunks(self.secret, self._outgoing, header, parts):
            self._sock.sendall(chunk)
        return msg_id

    def _receive(self, counter: FrameCounter | None = None, max_frame_bytes: int | None = None) -> Envelope:
        """The next frame from the server (of ``counter``'s direction: the session's unless told)."""
        counter = counter or self._incoming
        limit = max_frame_bytes or self.max_frame_bytes
        header, payload = recv_frame(self._sock, self.secret, counter, limit)
        return envelope_from_frame(header, payload)

    def request(self, msg: Message) -> Message:
        """Send and wait for the reply; ``RemoteError`` if the server answers ErrorReply or rejects us."""
        with self._lock:
            try:
                msg_id = self._send(msg, None)
            except OSError as e:  # the server closed on us mid-write; its ErrorReply may say why
                self._raise_why_closed(e)
            while True:
                env = self._receive()
                if env.reply_to == msg_id:
                    if isinstance(env.message, ErrorReply):
                        raise RemoteError(
                            f"{self.peer} answered {msg.TYPE!r} with an error: {env.message.message}"
                        )
                    return env.message
                if env.reply_to is None and isinstance(env.message, ErrorReply):
                    raise RemoteError(f"{self.peer} rejected this connection: {env.message.message}")
                if env.reply_to is None:
                    self.inbox.append(env)
                # else: a late reply to an abandoned request; drop it

    def _raise_why_closed(self, error: OSError) -> NoReturn:
        why: ProtocolError = PeerClosedError(f"connection to {self.peer} lost while sending: {error}")
        try:
            self._sock.settimeout(0.5)
            while True:
                env = self._receive()
                if env.reply_to is None and isinstance(env.message, ErrorReply):
                    why = RemoteError(f"{self.peer} rejected this connection: {env.message.message}")
                    break
        except (ProtocolError, OSError):
            pass
        raise why

    def recv(self) -> Envelope:
        """The next message the server sent unasked (waits for one if none is queued)."""
        with self._lock:
            if self.inbox:
                return self.inbox.popleft()
            while True:
                env = self._receive()
                if env.reply_to is None:
                    return env

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
