"""The authenticated asyncio server base: handshake, per-connection dispatch, isolation of bad peers.

Owns the server side of a connection's life; not what the messages mean (the controller's handler does).

    accept ──> more than max_unauthenticated connections handshaking? ──> drop the OLDEST of them
           ──> ServerHello(fresh nonce); every later frame's MAC is bound to it (framing.py)
           ──> first frame within handshake_timeout, at most HANDSHAKE_MAX_FRAME_BYTES (its buffer grows
               with the bytes that arrive, not with the size the stranger declares),
               valid MAC, a Hello, accepted by on_hello? ──no──> ErrorReply (no file paths: the peer is
               unauthenticated), close THIS connection, warn (rate-limited: RejectionLog)
                 │yes
                 ├─> Welcome(connection_id)
                 └─> loop: message ─> handler(conn, envelope) ─> reply (if not None)
                       ProtocolError  ─> warn, ErrorReply, close this connection
                       (bad MAC: wrong secret, altered, replayed, reordered or reflected frame)
                       handler raises ─> ErrorReply to that request, keep serving
                       peer closes    ─> info log

What a stranger can make the server hold is bounded: max_unauthenticated x (HANDSHAKE_MAX_FRAME_BYTES +
the stream buffer), for at most handshake_timeout each. Dropping the oldest (not refusing the newest)
keeps a flood from locking the job's own processes out: their handshake takes milliseconds.

Every other connection is untouched by what happens on one of them. Messages of one connection are
handled one at a time, in order; a handler that wants concurrency starts a task and answers later with
``conn.send(reply, reply_to=envelope.id)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Self

from hpc_rl.protocol.connection import STREAM_BUFFER_BYTES, Connection, Envelope
from hpc_rl.protocol.errors import HandshakeError, PeerClosedError, ProtocolError
from hpc_rl.protocol.frame_signer import FrameSigner
from hpc_rl.protocol.framing import DEFAULT_MAX_FRAME_BYTES, HANDSHAKE_MAX_FRAME_BYTES
from hpc_rl.protocol.messages import ErrorReply, Hello, Message, Welcome
from hpc_rl.protocol.rejections import RejectionLog
from hpc_rl.protocol.secret import Secret

log = logging.getLogger("hpc_rl.protocol")

Handler = Callable[[Connection, Envelope], Awaitable[Message | None]]
HelloHook = Callable[[Connection, Hello], Awaitable[dict | None]]
"""Validates a Hello (raise ProtocolError to refuse the peer); may return info for the Welcome."""
CloseHook = Callable[[Connection, BaseException | None], Awaitable[None]]

_REJECT_LINGER_S = 0.5
_REJECT_DRAIN_BYTES = 4 << 20


class Server:
    """An authenticated TCP server; ``connections`` holds the live, handshaken ones by id."""

    def __init__(
        self,
        secret: Secret,
        handler: Handler,
        *,
        on_hello: HelloHook | None = None,
        on_close: CloseHook | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        handshake_timeout: float = 5.0,
        max_unauthenticated: int = 32,
        signer: FrameSigner | None = None,
    ) -> None:
        self.secret, self.handler = secret, handler
        self.signer = signer
        """Computes the MACs of big frames to the peers in a process of its own (frame_signer.py)."""
        self.on_hello, self.on_close = on_hello, on_close
        self.max_frame_bytes = max_frame_bytes
        self.handshake_timeout = handshake_timeout
        self.max_unauthenticated = max_unauthenticated
        self.rejections = RejectionLog(log)
        self.connections: dict[int, Connection] = {}
        self._handshaking: dict[int, asyncio.Task[None]] = {}
        """Connections not authenticated yet, oldest first."""
        self._ids = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (port 0 picks a free one; see ``self.port``)."""
        self._server = await asyncio.start_server(self._on_accept, host, port, limit=STREAM_BUFFER_BYTES)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound."""
        assert self._server is not None, "server not started"
        return self._server.sockets[0].getsockname()[:2]

    @property
    def port(self) -> int:
        return self.address[1]

    async def close(self) -> None:
        """Stop accepting, close every connection, wait for their tasks."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.rejections.flush()
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = Connection(reader, writer, self.secret, max_frame_bytes=self.max_frame_bytes, signer=self.signer)
        conn_id = next(self._ids)
        error: BaseException | None = None
        self._admit(conn_id, task)
        try:
            try:
                hello = await self._handshake(conn, conn_id)
            finally:
                self._handshaking.pop(conn_id, None)
            self.connections[conn_id] = conn
            log.info(
                "connection %d from %s: %s rank %s/%s (host %s pid %s)",
                conn_id,
                conn.peer,
                hello.role,
                hello.rank,
                hello.world_size,
                hello.host,
                hello.pid,
            )
            await self._serve_connection(conn)
        except PeerClosedError as e:
            error = e
            log.info("connection %d from %s closed by the peer", conn_id, conn.peer)
        except ProtocolError as e:
            error = e
            if conn.hello is None:  # a stranger: no file paths in the reply, no flood of warnings
                self.rejections.refused(conn.peer, str(e))
                await self._reject(conn, self._public_reason(str(e)))
            else:
                log.warning("rejecting connection %d from %s: %s", conn_id, conn.peer, e)
                await self._reject(conn, str(e))
        except (OSError, asyncio.IncompleteReadError) as e:
            error = e
            log.info("connection %d from %s lost: %s", conn_id, conn.peer, e)
        except asyncio.CancelledError:
            error = PeerClosedError("server closing")
            if conn.hello is None and self._server is not None and self._server.is_serving():
                self.rejections.refused(conn.peer, f"dropped while authenticating: more than "
                                                   f"{self.max_unauthenticated} connections authenticating at once")
        except Exception as e:  # a bug in a hook: keep the server alive, tell the log
            error = e
            log.exception("connection %d from %s: internal error", conn_id, conn.peer)
            await self._reject(conn, f"internal server error: {type(e).__name__}: {e}")
        finally:
            was_live = self.connections.pop(conn_id, None) is not None
            with contextlib.suppress(Exception):
                await conn.close()
            if was_live and self.on_close is not None:
                with contextlib.suppress(Exception):
                    await self.on_close(conn, error)
            self._tasks.discard(task)

    def _admit(self, conn_id: int, task: asyncio.Task[None]) -> None:
        """Count a new unauthenticated connection; over the limit, drop the oldest one still handshaking."""
        while len(self._handshaking) >= self.max_unauthenticated:
            self._handshaking.pop(next(iter(self._handshaking))).cancel()
        self._handshaking[conn_id] = task

    def _public_reason(self, reason: str) -> str:
        """What an unauthenticated peer is told: the reason without where the job's secret lives."""
        return reason.replace(f" ({self.secret.origin})", "").replace(self.secret.origin, "<the job's secret>")

    async def _handshake(self, conn: Connection, conn_id: int) -> Hello:
        try:
            env = await asyncio.wait_for(self._server_hello_then_hello(conn), self.handshake_timeout)
        except TimeoutError:
            raise HandshakeError(f"no Hello within {self.handshake_timeout} s of connecting") from None
        except PeerClosedError:
            raise HandshakeError("the peer closed the connection before sending Hello") from None
        if not isinstance(env.message, Hello):
            raise HandshakeError(f"the first message must be 'hello', got {env.message.TYPE!r}")
        conn.hello = env.message
        info = await self.on_hello(conn, env.message) if self.on_hello is not None else None
        await conn.send(Welcome(connection_id=conn_id, info=info or {}), reply_to=env.id)
        return env.message

    @staticmethod
    async def _server_hello_then_hello(conn: Connection) -> Envelope:
        await conn.send_server_hello()
        return await conn.read_envelope(HANDSHAKE_MAX_FRAME_BYTES, grow_with_input=True)

    async def _serve_connection(self, conn: Connection) -> None:
        while True:
            env = await conn.recv()
            try:
                reply = await self.handler(conn, env)
            except ProtocolError:
                raise
            except Exception as e:
                log.exception("handler failed on %r from %s", env.message.TYPE, conn.peer)
                reply = ErrorReply(message=f"{type(e).__name__}: {e}")
            if reply is not None:
                await conn.send(reply, reply_to=env.id)

    async def _reject(self, conn: Connection, reason: str) -> None:
        """Best effort: tell the peer why, then close; linger briefly so the reason is not lost to a RST."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.send_final(ErrorReply(message=reason)), _REJECT_LINGER_S)
            if conn.writer.can_write_eof():
                conn.writer.write_eof()
            if not conn.reader_active:  # discard what the peer still sends, up to a bound
                deadline = asyncio.get_running_loop().time() + _REJECT_LINGER_S
                drained = 0
                while drained < _REJECT_DRAIN_BYTES:
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    chunk = await asyncio.wait_for(conn.reader.read(1 << 16), left)
                    if not chunk:
                        break
                    drained += len(chunk)


async def serve(
    host: str,
    port: int,
    secret: Secret,
    handler: Handler,
    **options: object,
) -> Server:
    """Start an authenticated server (options: see ``Server``); close it with ``await server.close()``."""
    server = Server(secret, handler, **options)  # type: ignore[arg-type]
    await server.start(host, port)
    return server
