"""Messages over asyncio streams: ``Connection`` (request/reply matched by ids, plus unsolicited messages
in both directions), and ``connect`` for async clients.

Owns turning messages into frames and back, request ids, a connection's frame counters (see framing.py)
and what a client does with a server's rejection. The server side (handshake, isolation of bad peers) is
server.py; the blocking client for non-async code (torchrun ranks) is blocking.py.

A connection opens with the server's ``ServerHello`` (a fresh nonce), then the client's ``Hello`` and the
server's ``Welcome``::

    client                                   server
      │ <──── ServerHello(nonce)   [server hello binding]
      │ ────> Hello                [nonce, client->server #0]
      │ <──── Welcome              [nonce, server->client #0]
      │ ────> request              [nonce, client->server #1]  ... and so on, each side counting

Only the server brings freshness: a client talking to an impostor that answers on the controller's
address with a recorded server stream cannot tell (that impostor needs the address, not the secret).

Frame header of a message: ``{"type", "v", "fields", "arrays", "id", "reply_to"}``; ``id`` numbers the
messages a side sends on a connection (from 1); a reply carries the request's ``id`` in ``reply_to``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from hpc_rl.protocol.arrays import decode_arrays, encode_arrays
from hpc_rl.protocol.errors import (
    HandshakeError,
    MalformedFrameError,
    PeerClosedError,
    ProtocolError,
    RemoteError,
)
from hpc_rl.protocol.frame_signer import FrameSigner
from hpc_rl.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    HANDSHAKE_MAX_FRAME_BYTES,
    NONCE_BYTES,
    Buffer,
    FrameCounter,
    read_frame,
    session_counters,
    unsigned_frame,
)
from hpc_rl.protocol.messages import (
    ErrorReply,
    Hello,
    Message,
    ServerHello,
    Welcome,
    decode_message,
    encode_message,
)
from hpc_rl.protocol.secret import Secret

log = logging.getLogger("hpc_rl.protocol")

STREAM_BUFFER_BYTES = 1 << 20
WRITE_SLICE_BYTES = 1 << 20
"""Big payloads are handed to the transport in slices of this size (`Connection._write`)."""
_WHY_CLOSED_WAIT_S = 0.5


@dataclass
class Envelope:
    """A received message with its frame ids."""

    message: Message
    id: int
    reply_to: int | None = None


def message_frame(
    msg: Message, *, id: int = 0, reply_to: int | None = None
) -> tuple[dict[str, Any], list[Buffer]]:
    """(frame header, payload buffers) of a message."""
    header, arrays = encode_message(msg)
    descriptors, parts = encode_arrays(arrays)
    header.update(arrays=descriptors, id=id, reply_to=reply_to)
    return header, [*parts]


def envelope_from_frame(header: dict[str, Any], payload: memoryview) -> Envelope:
    """The message a verified frame carries."""
    msg_id, reply_to = header.get("id", 0), header.get("reply_to")
    if not isinstance(msg_id, int) or not (reply_to is None or isinstance(reply_to, int)):
        raise MalformedFrameError(f"bad frame ids: id={msg_id!r} reply_to={reply_to!r}")
    message = decode_message(header, decode_arrays(header.get("arrays", []), payload))
    return Envelope(message=message, id=msg_id, reply_to=reply_to)


def nonce_of_server_hello(env: Envelope, peer: str) -> bytes:
    """The connection nonce a client reads from the server's first frame."""
    if not isinstance(env.message, ServerHello):
        raise HandshakeError(
            f"{peer} opened with {env.message.TYPE!r}, not 'server_hello' (an older hpc_rl controller?)"
        )
    try:
        nonce = bytes.fromhex(env.message.nonce)
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise HandshakeError(f"{peer} sent a server hello whose nonce is not {NONCE_BYTES} bytes of hex")
    return nonce


async def read_envelope(
    reader: asyncio.StreamReader,
    secret: Secret,
    counter: FrameCounter,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Envelope:
    """Read the next message of ``counter``'s direction, with its ids."""
    header, payload = await read_frame(reader, secret, counter, max_frame_bytes)
    return envelope_from_frame(header, payload)


class Connection:
    """One authenticated stream: send, request (await the matching reply), receive unsolicited messages.

    Nothing but the server hello travels until ``send_server_hello`` (server) or ``read_server_hello``
    (client) has bound the connection to its nonce. ``request``/``recv`` start a background reader on
    first use; until then ``read_envelope`` reads directly (the server's handshake does). ``drain`` waits
    for the socket buffer to be empty (write buffer limit 0), so a caller may reuse an array's memory as
    soon as ``send`` returns.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        secret: Secret,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        signer: FrameSigner | None = None,
    ) -> None:
        self.reader, self.writer, self.secret = reader, writer, secret
        self.max_frame_bytes = max_frame_bytes
        self.signer = signer
        """Computes big frames' MACs in a process of its own (frame_signer.py); None: all here."""
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.hello: Hello | None = None
        """The peer's Hello (set by the server after the handshake)."""
        self.welcome: Welcome | None = None
        """The server's Welcome (set by ``connect``)."""
        self.nonce: bytes | None = None
        """This connection's nonce, once the server hello was sent or read."""
        self._outgoing: FrameCounter | None = None
        self._incoming: FrameCounter | None = None
        self._next_id = 1
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._inbox: asyncio.Queue[Envelope | BaseException] = asyncio.Queue()
        self._error: BaseException | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        writer.transport.set_write_buffer_limits(high=0)
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def send_server_hello(self) -> None:
        """Server side, first thing on a connection: send a fresh nonce and bind the connection to it."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        async with self._write_lock:
            await self._write(ServerHello(nonce=nonce.hex()), 0, None, FrameCounter.server_hello())
            self._bind(nonce, server=True)

    async def read_server_hello(self) -> None:
        """Client side, first thing on a connection: read the server's nonce and bind the connection to it."""
        counter = FrameCounter.server_hello()
        env = await read_envelope(self.reader, self.secret, counter, HANDSHAKE_MAX_FRAME_BYTES)
        self._bind(nonce_of_server_hello(env, self.peer), server=False)

    def _bind(self, nonce: bytes, *, server: bool) -> None:
        self.nonce = nonce
        self._outgoing, self._incoming = session_counters(nonce, server=server)

    def _counter(self, counter: FrameCounter | None) -> FrameCounter:
        if counter is None:
            raise HandshakeError(f"connection to {self.peer} used before its server hello")
        return counter

    async def read_envelope(self, max_frame_bytes: int | None = None, *, grow_with_input: bool = False) -> Envelope:
        """Read the next frame directly (only before the background reader is started); with
        `grow_with_input` (an unauthenticated peer) its buffer grows with what arrives (see read_frame)."""
        assert self._reader_task is None, "read_envelope() after the background reader started; use recv()"
        counter = self._counter(self._incoming)
        header, payload = await read_frame(self.reader, self.secret, counter,
                                           max_frame_bytes or self.max_frame_bytes, grow_with_input=grow_with_input)
        return envelope_from_frame(header, payload)

    async def send(self, msg: Message, *, reply_to: int | None = None) -> int:
        """Send a message; return its id (what a reply to it will carry in ``reply_to``)."""
        if self._error is not None:
            raise self._closed_error()
        async with self._write_lock:
            msg_id = self._next_id
            self._next_id += 1
            try:
                await self._write(msg, msg_id, reply_to)
            except OSError as e:
                raise PeerClosedError(
                    f"connection to {self.peer} lost while sending {msg.TYPE!r}: {e}"
                ) from None
        return msg_id

    async def send_final(self, msg: Message) -> None:
        """Send ``msg`` even on a failed connection (the server's reason for closing it); a no-op before
        the server hello, when the peer could not verify it anyway."""
        if self._outgoing is None:
            return
        async with self._write_lock:
            msg_id = self._next_id
            self._next_id += 1
            await self._write(msg, msg_id, None)

    async def _write(self, msg: Message, msg_id: int, reply_to: int | None, counter: FrameCounter | None = None) -> None:
        """Write one frame (of the session's outgoing counter unless told) and wait for the transport to
        take it; the caller holds the write lock, so frame numbers follow the wire order."""
        header, parts = message_frame(msg, id=msg_id, reply_to=reply_to)
        frame = unsigned_frame(counter or self._counter(self._outgoing), header, parts)
        job = await self.signer.begin(frame) if self.signer is not None else None
        if job is None:
            await self._write_chunks(frame.chunks(frame.mac(self.secret)))
            return
        try:  # the frame goes out while the signer hashes it; its MAC, the last 32 bytes, when it is known
            await self._write_chunks(frame.chunks(None))
            tag = await job.tag()
            await self._write_chunks([tag if tag is not None else frame.mac(self.secret)])
        finally:
            job.abandon()

    async def _write_chunks(self, chunks: list[Buffer]) -> None:
        transport = self.writer.transport
        for chunk in chunks:
            # One by one (writelines joins, i.e. copies, them on Python 3.11), and big arrays in slices with a
            # wait while the transport holds more than a slice: what the socket does not take is copied into
            # the transport's buffer, which otherwise grew to the whole message by repeated reallocation
            # (1.6 of the controller's 20 CPU s with 3,440-token samples at 256 simulated engines).
            view = memoryview(chunk).cast("B")
            for start in range(0, view.nbytes, WRITE_SLICE_BYTES):
                self.writer.write(view[start:start + WRITE_SLICE_BYTES])
                if transport.get_write_buffer_size() > WRITE_SLICE_BYTES:
                    await self.writer.drain()
        await self.writer.drain()

    async def reply(self, to: Envelope, msg: Message) -> int:
        """Answer a received request."""
        return await self.send(msg, reply_to=to.id)

    async def request(self, msg: Message, *, timeout: float | None = None) -> Message:
        """Send ``msg`` and return the peer's reply; raise ``RemoteError`` if the peer answers ErrorReply."""
        self._start_reader()
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        async with self._write_lock:  # register before the reply can possibly arrive
            msg_id = self._next_id
            self._next_id += 1
            self._pending[msg_id] = future
            try:
                if self._error is not None:
                    raise self._closed_error()
                await self._write(msg, msg_id, None)
            except OSError as e:  # the peer closed on us mid-write; its ErrorReply may say why
                why = await self._why_closed(future, f"lost while sending {msg.TYPE!r}: {e}")
                self._pending.pop(msg_id, None)
                raise why from None
            except BaseException:
                self._pending.pop(msg_id, None)
                raise
        try:
            reply = await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(msg_id, None)
        if isinstance(reply, ErrorReply):
            raise RemoteError(f"{self.peer} answered {msg.TYPE!r} with an error: {reply.message}")
        return reply

    async def _why_closed(self, future: asyncio.Future[Message], what: str) -> ProtocolError:
        try:
            await asyncio.wait_for(asyncio.shield(future), _WHY_CLOSED_WAIT_S)
        except ProtocolError as e:
            return e
        except (TimeoutError, OSError):
            pass
        return PeerClosedError(f"connection to {self.peer} {what}")

    async def recv(self) -> Envelope:
        """The next message that is not a reply to one of our requests."""
        self._start_reader()
        item = await self._inbox.get()
        if isinstance(item, BaseException):
            self._inbox.put_nowait(item)  # every later recv() raises too
            raise item
        return item

    @property
    def reader_active(self) -> bool:
        """True while the background reader owns the stream."""
        return self._reader_task is not None and not self._reader_task.done()

    def _closed_error(self) -> BaseException:
        err = self._error
        return (
            err
            if isinstance(err, ProtocolError)
            else PeerClosedError(f"connection to {self.peer} is closed: {err}")
        )

    def _start_reader(self) -> None:
        if self._reader_task is None:
            self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            counter = self._counter(self._incoming)
            while True:
                env = await read_envelope(self.reader, self.secret, counter, self.max_frame_bytes)
                if env.reply_to is not None:
                    future = self._pending.get(env.reply_to)
                    if future is not None and not future.done():
                        future.set_result(env.message)
                    else:
                        log.debug("dropping a reply from %s to unknown request %s", self.peer, env.reply_to)
                    continue
                self._inbox.put_nowait(env)
                if isinstance(env.message, ErrorReply):  # unsolicited: the peer is closing on us, say why
                    self._fail(RemoteError(f"{self.peer} rejected this connection: {env.message.message}"))
        except (ProtocolError, OSError, asyncio.IncompleteReadError) as e:
            self._fail(e)
        except Exception as e:  # a bug while decoding: fail loudly rather than leave requests hanging
            log.exception("internal error reading from %s", self.peer)
            self._fail(ProtocolError(f"internal error reading from {self.peer}: {type(e).__name__}: {e}"))
        except asyncio.CancelledError:
            self._fail(PeerClosedError(f"connection to {self.peer} was closed locally"))
            raise

    def _fail(self, err: BaseException) -> None:
        if self._error is None or isinstance(err, RemoteError):
            self._error = err
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self._closed_error())
        self._inbox.put_nowait(self._closed_error())

    async def close(self) -> None:
        """Close the stream and stop the reader; pending requests fail with ``PeerClosedError``."""
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        elif self._error is None:
            self._fail(PeerClosedError(f"connection to {self.peer} was closed locally"))
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (OSError, ConnectionError):
            pass


def default_hello(role: str = "status") -> Hello:
    """A Hello naming this process (host, pid) in the given role."""
    return Hello(role=role, host=socket.gethostname(), pid=os.getpid())  # type: ignore[arg-type]


async def connect(
    host: str,
    port: int,
    secret: Secret,
    hello: Hello | None = None,
    *,
    timeout: float = 30.0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Connection:
    """Open an authenticated connection: read the server hello, send Hello, wait for Welcome
    (``conn.welcome``)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, limit=STREAM_BUFFER_BYTES), timeout
    )
    conn = Connection(reader, writer, secret, max_frame_bytes=max_frame_bytes)
    try:
        try:
            await asyncio.wait_for(conn.read_server_hello(), timeout)
        except TimeoutError:
            raise HandshakeError(f"no server hello from {host}:{port} within {timeout} s") from None
        reply = await conn.request(hello or default_hello(), timeout=timeout)
    except TimeoutError:
        await conn.close()
        raise HandshakeError(f"no Welcome from {host}:{port} within {timeout} s") from None
    except BaseException:
        await conn.close()
        raise
    if not isinstance(reply, Welcome):
        await conn.close()
        raise HandshakeError(f"{host}:{port} answered Hello with {reply.TYPE!r}, not 'welcome'")
    conn.welcome = reply
    return conn
