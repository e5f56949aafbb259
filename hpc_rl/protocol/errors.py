"""Errors of the controller protocol: one family, so a caller catches ``ProtocolError`` once.

Owns the exception types and nothing else. Every error carries a message that says what was wrong and,
where it helps, what to do; the server logs that message and sends it to the peer before closing.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class: the connection that raised it cannot be trusted any more and is closed."""


class BadMagicError(ProtocolError):
    """The bytes on the connection are not an hpc_rl frame (garbage, HTTP, another protocol)."""


class VersionMismatchError(ProtocolError):
    """The peer speaks another version of the frame format."""


class BadMacError(ProtocolError):
    """The frame's HMAC does not verify: the peer does not hold this job's secret, or bytes were altered."""


class FrameTooLargeError(ProtocolError):
    """The frame's declared size exceeds the receiver's limit; rejected before reading its body."""


class TruncatedFrameError(ProtocolError):
    """The connection ended in the middle of a frame."""


class PeerClosedError(ProtocolError):
    """The peer closed the connection cleanly between two frames (a normal end, not an attack)."""


class MalformedFrameError(ProtocolError):
    """The frame authenticated but its header or array descriptors do not make sense (a peer bug)."""


class UnknownMessageError(ProtocolError):
    """The message type or its version is not known to this side."""


class FieldMismatchError(ProtocolError):
    """A message's fields do not match its dataclass (missing, unknown or of the wrong type)."""


class HandshakeError(ProtocolError):
    """The first frame on a connection was not a valid ``Hello`` in time, or the ``Welcome`` was missing."""


class RemoteError(ProtocolError):
    """The peer answered a request with ``ErrorReply``; ``str(err)`` is the peer's message."""
