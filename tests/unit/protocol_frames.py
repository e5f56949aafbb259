"""Test helper over `hpc_rl.protocol.framing`: one frame as a single bytes object, for tests that cut, flip
or replay its bytes (production writes `framing.frame_chunks` without joining them; moved here, issue 30)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpc_rl.protocol.framing import Buffer, FrameCounter, frame_chunks
from hpc_rl.protocol.secret import Secret


def encode_frame(secret: Secret, counter: FrameCounter, header: dict[str, Any], payload: Sequence[Buffer] = ()) -> bytes:
    """One frame as a single bytes object; advances ``counter``."""
    return b"".join(
        bytes(c) if isinstance(c, memoryview) else c for c in frame_chunks(secret, counter, header, payload)
    )
