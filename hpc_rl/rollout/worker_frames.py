"""The frames between the controller and its answer workers (answer_pool.py, answer_workers.py and the worker-side
ops beside them: worker_probes.py): `<u32 header bytes><u32 payload bytes>`, a JSON header, then the payload
(raw machine numbers or an engine's body). Over a local socketpair only; JSON and raw numbers, no pickle.

Owns: the prefix, encoding one frame as buffers to write in order, and reading one from a StreamReader. Its own
module so that each worker-side op can answer in frames without importing the worker's program (an import cycle).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

PREFIX = struct.Struct("<II")
"""A frame's header and payload sizes."""


def encode_frame(header: dict[str, Any], payload: list[Any] | tuple[Any, ...] = ()) -> list[Any]:
    """The buffers of one frame, to write in order (the payload's buffers are not copied)."""
    head = orjson.dumps(header)
    size = sum(memoryview(part).nbytes for part in payload)
    return [PREFIX.pack(len(head), size), head, *payload]


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """The next frame's (header, payload); asyncio.IncompleteReadError when the other side is gone."""
    head_size, size = PREFIX.unpack(await reader.readexactly(PREFIX.size))
    header = orjson.loads(await reader.readexactly(head_size))
    return header, (await reader.readexactly(size) if size else b"")
