"""Wire framing: length-prefixed, versioned, HMAC-authenticated frames; reading them from asyncio streams
and from blocking sockets.

Owns the byte layout and its checks, nothing about message types or arrays::

    prefix   20 bytes  "!4sHHIQ": magic b"HRLP", frame format version u16, flags u16,
                       header length u32, payload length u64
    header   JSON (utf-8) object: message type, ids, fields, array descriptors
    payload  raw bytes of the message's arrays (laid out by arrays.py)
    mac      32 bytes  HMAC-SHA256(job secret, prefix + header + payload)

The prefix is checked (magic, version, flags, declared size against the receiver's limit) before a single
byte of the body is read or allocated; the MAC is checked before the header is parsed, so an
unauthenticated peer never reaches the JSON parser.
"""

from __future__ import annotations

import asyncio
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
PROTOCOL_VERSION = 1
PREFIX = struct.Struct("!4sHHIQ")
MAC_BYTES = 32
DEFAULT_MAX_FRAME_BYTES = 1 << 30
"""Largest frame (prefix + header + payload + MAC) a receiver accepts unless told otherwise: 1 GiB."""
HANDSHAKE_MAX_FRAME_BYTES = 1 << 20
"""Limit for a connection's first frame, read before the peer is authenticated (bounds what a stranger
can make the server allocate)."""

Buffer = bytes | bytearray | memoryview
_CHUNK = 1 << 20


def frame_chunks(secret: Secret, header: dict[str, Any], payload: Sequence[Buffer] = ()) -> list[Buffer]:
    """Encode one frame as a list of buffers to write in order (array bytes are not copied)."""
    header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=True).encode("utf-8")
    payload_len = sum(memoryview(p).nbytes for p in payload)
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(header_bytes), payload_len)
    mac = hmac.new(secret.key, prefix, hashlib.sha256)
    mac.update(header_bytes)
    for part in payload:
        mac.update(part)
    return [prefix, header_bytes, *payload, mac.digest()]


def encode_frame(secret: Secret, header: dict[str, Any], payload: Sequence[Buffer] = ()) -> bytes:
    """One frame as a single bytes object (convenient for small frames and tests)."""
    return b"".join(
        bytes(c) if isinstance(c, memoryview) else c for c in frame_chunks(secret, header, payload)
    )


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
    secret: Secret, prefix: bytes, body: bytearray, header_len: int
) -> tuple[dict[str, Any], memoryview]:
    """Verify the MAC of ``prefix + body`` and parse the header; return (header, payload view into body)."""
    view = memoryview(body)
    mac = hmac.new(secret.key, prefix, hashlib.sha256)
    mac.update(view[:-MAC_BYTES])
    if not hmac.compare_digest(mac.digest(), view[-MAC_BYTES:]):
        raise BadMacError(
            f"bad MAC: the peer does not hold this job's secret ({secret.origin}), or the frame was altered"
        )
    try:
        header = json.loads(view[:header_len].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MalformedFrameError(f"frame header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise MalformedFrameError(f"frame header must be a JSON object, got {type(header).__name__}")
    return header, view[header_len:-MAC_BYTES]


async def read_frame(
    reader: asyncio.StreamReader, secret: Secret, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[dict[str, Any], memoryview]:
    """Read one authenticated frame from an asyncio stream; return (header, payload)."""
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
    body = bytearray(size)
    view = memoryview(body)
    got = 0
    while got < size:  # chunked: the stream's own buffer stays small even for a 1 GiB frame
        chunk = await reader.read(min(size - got, _CHUNK))
        if not chunk:
            raise TruncatedFrameError(
                f"connection closed after {got} of the {size} body bytes of a frame "
                f"(header {header_len}, payload {payload_len})"
            )
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    return open_frame(secret, prefix, body, header_len)


async def write_frame(
    writer: asyncio.StreamWriter, secret: Secret, header: dict[str, Any], payload: Sequence[Buffer] = ()
) -> None:
    """Write one frame and wait for the transport to accept it (see ``Connection`` for flushing)."""
    for chunk in _coalesce(frame_chunks(secret, header, payload)):
        writer.write(chunk)
    await writer.drain()


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
    sock: socket.socket, secret: Secret, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[dict[str, Any], memoryview]:
    """Blocking twin of ``read_frame`` for a plain socket (reads straight into the frame's buffer)."""
    prefix = bytearray(PREFIX.size)
    _recv_exactly_into(sock, memoryview(prefix), "prefix")
    header_len, payload_len = parse_prefix(bytes(prefix), max_frame_bytes)
    body = bytearray(header_len + payload_len + MAC_BYTES)
    _recv_exactly_into(sock, memoryview(body), "body")
    return open_frame(secret, bytes(prefix), body, header_len)


def send_frame(
    sock: socket.socket, secret: Secret, header: dict[str, Any], payload: Sequence[Buffer] = ()
) -> None:
    """Blocking twin of ``write_frame``."""
    for chunk in _coalesce(frame_chunks(secret, header, payload)):
        sock.sendall(chunk)
