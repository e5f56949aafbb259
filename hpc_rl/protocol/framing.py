"""Wire framing: length-prefixed, versioned, HMAC-authenticated frames bound to their place in their
connection; encoding them as buffers to write, reading them from asyncio streams and blocking sockets.

Owns the byte layout, its checks and the per-direction frame counters, nothing about message types or
arrays::

    prefix   20 bytes  "!4sHHIQ": magic b"HRLP", frame format version u16, flags u16,
                       header length u32, payload length u64
    header   JSON (utf-8) object: message type, ids, fields, array descriptors
    payload  raw bytes of the message's arrays (laid out by arrays.py)
    mac      32 bytes  HMAC-SHA256(job secret, prefix + header + payload + binding)

    binding  41 bytes  "!32sBQ", never sent (both sides know it): connection nonce, direction u8
                       (0 server hello, 1 client->server, 2 server->client), frame number u64

A connection starts with the server's hello: a frame bound to (32 zero bytes, 0, 0) whose message carries
a fresh random 32-byte nonce. From then on each direction numbers its frames from 0 and binds frame n
to (nonce, direction, n). A frame captured on one connection fails the MAC check on any other (another
nonce); re-sent or reordered on its own connection it fails (another number); sent back to its sender
it fails (another direction). On a failed check the receiver tries the nearby bindings of the same
connection (cheap: the HMAC of prefix + header + payload is computed once), so the error says "replayed"
or "reflected" when it can. The server's hello itself can be replayed to a client, but only by whoever
answers on the controller's address; see connection.py.

The header stays stdlib JSON: in process a small message costs ~80 us end to end (encode, MAC, verify,
decode; benchmarks/bench_protocol.py's reference lines), ~19 us of it JSON. orjson writes NaN as null (a
trainer's NaN loss would arrive as None) and msgspec/msgpack would be a new dependency (and a wire change)
for at most those 19 us, on a channel that carries a few messages per trainer rank per rollout; the bulk
(arrays) is raw bytes already, where HMAC-SHA256 (~1.5 GB/s) sets the pace.

The prefix is checked (magic, version, flags, declared size against the receiver's limit) before a single
byte of the body is read or allocated (and for a peer not yet authenticated the body's buffer grows only
with the bytes it actually sends); the MAC is checked before the header is parsed, so an
unauthenticated peer never reaches the JSON parser.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import json
import socket
import struct
from collections.abc import Sequence
from typing import Any

from hpc_rl.protocol.errors import (
    BadMacError,
    BadMagicError,
    FrameTooLargeError,
    MalformedFrameError,
    PeerClosedError,
    TruncatedFrameError,
    VersionMismatchError,
)
from hpc_rl.protocol.secret import Secret

MAGIC = b"HRLP"
PROTOCOL_VERSION = 2
"""v2: every MAC is bound to (connection nonce, direction, frame number); the server speaks first."""
PREFIX = struct.Struct("!4sHHIQ")
MAC_BYTES = 32
NONCE_BYTES = 32
BINDING = struct.Struct("!32sBQ")
DEFAULT_MAX_FRAME_BYTES = 1 << 30
"""Largest frame (prefix + header + payload + MAC) a receiver accepts unless told otherwise: 1 GiB."""
HANDSHAKE_MAX_FRAME_BYTES = 64 << 10
"""Limit for a connection's first frame, read before the peer is authenticated (bounds what a stranger
can make the server allocate): 64 KiB, room for a Hello (who is calling) and nothing bulky. State a
client brings along (a trainer's resume state) goes in a message after the handshake (`ResumeState`)."""

Buffer = bytes | bytearray | memoryview
_CHUNK = 1 << 20
_DIAGNOSIS_WINDOW = 256
"""How many frame numbers either side of the expected one a failed MAC check tries, to name the cause."""


class Direction(enum.IntEnum):
    """Which way a frame travels; part of what its MAC is bound to."""

    SERVER_HELLO = 0
    CLIENT_TO_SERVER = 1
    SERVER_TO_CLIENT = 2

    def describe(self) -> str:
        return {0: "server hello", 1: "client->server", 2: "server->client"}[self.value]


class FrameCounter:
    """One direction of one connection: the nonce and direction its frames' MACs are bound to, and the
    number of the next frame (from 0). Senders and receivers each keep one per direction and advance it
    once per frame, so a frame verifies only at its own place in its own connection."""

    __slots__ = ("direction", "next_number", "nonce")

    def __init__(self, nonce: bytes, direction: Direction) -> None:
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"a connection nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
        self.nonce, self.direction, self.next_number = nonce, direction, 0

    @classmethod
    def server_hello(cls) -> FrameCounter:
        """The binding of a connection's first server frame, sent before any nonce exists."""
        return cls(bytes(NONCE_BYTES), Direction.SERVER_HELLO)

    def binding(self, number: int | None = None, direction: Direction | None = None) -> bytes:
        """The 41 bytes frame ``number`` (default: the next one) of this connection is bound to."""
        number = self.next_number if number is None else number
        return BINDING.pack(self.nonce, self.direction if direction is None else direction, number)

    def take(self) -> bytes:
        """The binding of the next frame; the counter moves past it."""
        binding = self.binding()
        self.next_number += 1
        return binding


def session_counters(nonce: bytes, *, server: bool) -> tuple[FrameCounter, FrameCounter]:
    """(outgoing, incoming) counters of one side of the connection whose server hello carried ``nonce``."""
    to_server = FrameCounter(nonce, Direction.CLIENT_TO_SERVER)
    to_client = FrameCounter(nonce, Direction.SERVER_TO_CLIENT)
    return (to_client, to_server) if server else (to_server, to_client)


def frame_chunks(
    secret: Secret, counter: FrameCounter, header: dict[str, Any], payload: Sequence[Buffer] = ()
) -> list[Buffer]:
    """Encode the next frame of ``counter``'s direction as buffers to write in order: runs of small parts
    joined (one TCP segment instead of several), big arrays not copied.

    Advances ``counter``: the frames must reach the wire in the order this is called.
    """
    frame = unsigned_frame(counter, header, payload)
    return frame.chunks(frame.mac(secret))


class UnsignedFrame:
    """A frame whose MAC is yet to be computed, here (`mac`) or elsewhere (a frame signer process computes the
    same HMAC over head, payload and binding, in that order); `chunks(tag)` are then the bytes to write. Its
    frame number is taken: it must reach the wire before the next frame of its counter."""

    __slots__ = ("binding", "head", "payload", "payload_bytes")

    def __init__(self, head: bytes, payload: Sequence[Buffer], binding: bytes, payload_bytes: int) -> None:
        self.head = head
        """prefix + header bytes."""
        self.payload, self.payload_bytes = payload, payload_bytes
        self.binding = binding

    def mac(self, secret: Secret) -> bytes:
        """The frame's MAC, computed in this process."""
        mac = hmac.new(secret.key, self.head, hashlib.sha256)
        for part in self.payload:
            mac.update(part)
        mac.update(self.binding)
        return mac.digest()

    def chunks(self, tag: bytes | None) -> list[Buffer]:
        """The frame's bytes as buffers to write in order (see `frame_chunks`); without its last 32 bytes
        (the MAC) when ``tag`` is None: they follow once known."""
        if tag is not None and len(tag) != MAC_BYTES:
            raise ValueError(f"a frame MAC is {MAC_BYTES} bytes, got {len(tag)}")
        return _coalesce([self.head, *self.payload] + ([tag] if tag is not None else []))


def unsigned_frame(counter: FrameCounter, header: dict[str, Any], payload: Sequence[Buffer] = ()) -> UnsignedFrame:
    """The next frame of ``counter``'s direction, its MAC not computed yet. Advances ``counter``: the frames
    must reach the wire in the order this is called."""
    header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=True).encode("utf-8")
    payload_len = sum(memoryview(p).nbytes for p in payload)
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(header_bytes), payload_len)
    return UnsignedFrame(prefix + header_bytes, payload, counter.take(), payload_len)


def parse_prefix(prefix: bytes, max_frame_bytes: int) -> tuple[int, int]:
    """Check a frame's 20-byte prefix; return (header length, payload length). Nothing else is read yet."""
    magic, version, flags, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        hint = " (it looks like HTTP)" if prefix[:4] in (b"GET ", b"POST", b"PUT ", b"HEAD") else ""
        raise BadMagicError(
            f"not an hpc_rl frame: expected magic {MAGIC!r}, got {prefix[:8]!r}{hint}; "
            "this port speaks hpc_rl's controller protocol only"
        )
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"protocol version mismatch: the peer sent frame format v{version}, this side speaks "
            f"v{PROTOCOL_VERSION}; run the same hpc_rl version in every process of the job"
        )
    if flags != 0:
        raise MalformedFrameError(f"unknown frame flags {flags:#06x} (this side knows none)")
    total = PREFIX.size + header_len + payload_len + MAC_BYTES
    if total > max_frame_bytes:
        raise FrameTooLargeError(
            f"frame of {total} bytes declared (header {header_len}, payload {payload_len}) exceeds the "
            f"limit of {max_frame_bytes} bytes; rejected before reading it (split the data or raise "
            "max_frame_bytes on both sides)"
        )
    return header_len, payload_len


def open_frame(
    secret: Secret, counter: FrameCounter, prefix: bytes, body: bytearray, header_len: int
) -> tuple[dict[str, Any], memoryview]:
    """Verify the MAC of ``prefix + body`` as the next frame of ``counter`` (advanced only if it verifies)
    and parse the header; return (header, payload view into body)."""
    view = memoryview(body)
    unbound = hmac.new(secret.key, prefix, hashlib.sha256)
    unbound.update(view[:-MAC_BYTES])
    mac = unbound.copy()
    mac.update(counter.binding())
    tag = view[-MAC_BYTES:]
    if not hmac.compare_digest(mac.digest(), tag):
        raise _bad_mac_error(secret, counter, unbound, bytes(tag))
    counter.next_number += 1
    try:
        header = json.loads(view[:header_len].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MalformedFrameError(f"frame header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise MalformedFrameError(f"frame header must be a JSON object, got {type(header).__name__}")
    return header, view[header_len:-MAC_BYTES]


def _bad_mac_error(secret: Secret, counter: FrameCounter, unbound: hmac.HMAC, tag: bytes) -> BadMacError:
    """Why a frame failed: replayed/reordered or reflected within this connection if a nearby binding of
    it verifies, else a wrong secret, altered bytes, or a frame from another connection."""

    def verifies(binding: bytes) -> bool:
        mac = unbound.copy()
        mac.update(binding)
        return hmac.compare_digest(mac.digest(), tag)

    expected, here = counter.next_number, counter.direction
    if here is not Direction.SERVER_HELLO:
        numbers = range(max(0, expected - _DIAGNOSIS_WINDOW), expected + _DIAGNOSIS_WINDOW)
        for number in numbers:
            if number != expected and verifies(counter.binding(number)):
                return BadMacError(
                    f"bad MAC: replayed or reordered frame: it is frame #{number} of this connection's "
                    f"{here.describe()} stream, but #{expected} was due"
                )
        back = Direction(3 - here)  # client->server <-> server->client
        for number in numbers:
            if verifies(counter.binding(number, back)):
                return BadMacError(
                    f"bad MAC: reflected frame: it is frame #{number} of this connection's "
                    f"{back.describe()} stream, sent back to where it came from"
                )
        if verifies(FrameCounter.server_hello().binding()):
            return BadMacError(f"bad MAC: a server hello where {here.describe()} frame #{expected} was due")
    return BadMacError(
        f"bad MAC: the peer does not hold this job's secret ({secret.origin}), or the frame was altered "
        "or replayed from another connection"
    )


async def read_frame(
    reader: asyncio.StreamReader,
    secret: Secret,
    counter: FrameCounter,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    *,
    grow_with_input: bool = False,
) -> tuple[dict[str, Any], memoryview]:
    """Read the next authenticated frame of ``counter``'s direction from an asyncio stream.

    The body's buffer is allocated at the declared size before it is read (no copies for big frames),
    or, with ``grow_with_input`` (a peer not authenticated yet), grows with the bytes that actually
    arrive: a stranger who declares a big frame and sends nothing makes the reader allocate nothing."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise PeerClosedError("the peer closed the connection") from None
        raise TruncatedFrameError(
            f"connection closed after {len(e.partial)} of the {PREFIX.size} bytes of a frame prefix"
        ) from None
    header_len, payload_len = parse_prefix(prefix, max_frame_bytes)
    size = header_len + payload_len + MAC_BYTES
    body = bytearray() if grow_with_input else bytearray(size)
    got = 0
    while got < size:  # chunked: the stream's own buffer stays small even for a 1 GiB frame
        chunk = await reader.read(min(size - got, _CHUNK))
        if not chunk:
            raise TruncatedFrameError(
                f"connection closed after {got} of the {size} body bytes of a frame "
                f"(header {header_len}, payload {payload_len})"
            )
        if grow_with_input:
            body += chunk
        else:
            body[got : got + len(chunk)] = chunk
        got += len(chunk)
    return open_frame(secret, counter, prefix, body, header_len)


def _coalesce(chunks: list[Buffer]) -> list[Buffer]:
    """Join runs of small chunks (one TCP segment instead of several); leave big array buffers alone."""
    out: list[Buffer] = []
    pending: list[Buffer] = []
    for chunk in chunks:
        if memoryview(chunk).nbytes < _CHUNK // 16:
            pending.append(chunk)
            continue
        if pending:
            out.append(b"".join(pending))
            pending = []
        out.append(chunk)
    if pending:
        out.append(b"".join(pending))
    return out


def _recv_exactly_into(sock: socket.socket, view: memoryview, what: str) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and what == "prefix":
                raise PeerClosedError("the peer closed the connection")
            raise TruncatedFrameError(
                f"connection closed after {got} of the {len(view)} bytes of a frame {what}"
            )
        got += n


def recv_frame(
    sock: socket.socket,
    secret: Secret,
    counter: FrameCounter,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> tuple[dict[str, Any], memoryview]:
    """Blocking twin of ``read_frame`` for a plain socket (reads straight into the frame's buffer)."""
    prefix = bytearray(PREFIX.size)
    _recv_exactly_into(sock, memoryview(prefix), "prefix")
    header_len, payload_len = parse_prefix(bytes(prefix), max_frame_bytes)
    body = bytearray(header_len + payload_len + MAC_BYTES)
    _recv_exactly_into(sock, memoryview(body), "body")
    return open_frame(secret, counter, bytes(prefix), body, header_len)
