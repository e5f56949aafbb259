"""Strangers on the controller's port: a flood of connections that never authenticate does not grow the
server's memory beyond a bound nor fill its log, its replies do not name the secret file, and the job's
own clients still get in during the flood (a real server on 127.0.0.1; the rejection log's clock is fake)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from hpc_rl.protocol import framing
from hpc_rl.protocol.connection import connect, read_envelope
from hpc_rl.protocol.messages import ErrorReply, Hello, Ping, Pong, ServerHello
from hpc_rl.protocol.rejections import RejectionLog
from hpc_rl.protocol.server import Server, serve
from tests.unit.test_protocol_server import HELLO, SECRET, WRONG, echo_handler, frame_bytes

FLOOD = 300


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def stranger(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect, read the server hello, declare the largest first frame allowed, send a few bytes, wait."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    declared = framing.HANDSHAKE_MAX_FRAME_BYTES - framing.PREFIX.size - framing.MAC_BYTES
    writer.write(framing.PREFIX.pack(framing.MAGIC, framing.PROTOCOL_VERSION, 0, declared, 0) + b"{" * 100)
    await writer.drain()
    return reader, writer


def test_handshake_flood_is_bounded_in_memory_and_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[float, float, Server]:
        server = await serve("127.0.0.1", 0, SECRET, echo_handler, handshake_timeout=30.0)
        try:
            before = rss_mib()
            strangers = [await stranger(server.port) for _ in range(FLOOD)]
            await asyncio.sleep(0.5)  # let the server read what they sent
            during = rss_mib()
            good = await connect("127.0.0.1", server.port, SECRET, HELLO)  # the job's own process gets in
            assert await good.request(Ping(payload="in")) == Pong(payload="in")
            await good.close()
            for _, writer in strangers:
                writer.close()
            await asyncio.sleep(0.2)
        finally:
            await server.close()
        return before, during, server

    with caplog.at_level(logging.INFO, logger="hpc_rl.protocol"):
        before, during, server = asyncio.run(main())
    # Old code: every stranger made the server allocate HANDSHAKE_MAX_FRAME_BYTES (1 MiB): +300 MiB.
    assert during - before < 40, f"RSS grew from {before:.0f} to {during:.0f} MiB"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 10, f"{len(warnings)} warning lines for {FLOOD} strangers"
    assert "more unauthenticated connection(s)" in warnings[-1].getMessage()
    assert len(caplog.records) < FLOOD  # nor one info line per stranger
    assert server.rejections.total >= FLOOD - server.max_unauthenticated


def test_a_stranger_is_not_told_where_the_secret_file_is() -> None:
    async def main() -> str:
        server = await serve("127.0.0.1", 0, SECRET, echo_handler)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            hello = await read_envelope(reader, SECRET, framing.FrameCounter.server_hello())
            assert isinstance(hello.message, ServerHello)
            outgoing, _ = framing.session_counters(bytes.fromhex(hello.message.nonce), server=False)
            writer.write(frame_bytes(HELLO, outgoing, WRONG))
            await writer.drain()
            raw = await reader.read()  # the ErrorReply frame (readable: MACs sign, they do not encrypt)
            writer.close()
            return raw.decode("utf-8", errors="replace")
        finally:
            await server.close()

    reply = asyncio.run(main())
    assert "does not hold this job's secret" in reply
    assert SECRET.origin not in reply  # the old code: "... secret (/run/job/secret) ..."


def test_rejection_log_sums_up_after_a_burst() -> None:
    now = [0.0]
    records: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test_rejection_log")
    logger.addHandler(ListHandler())
    logger.propagate = False
    rejections = RejectionLog(logger, burst=2, window_s=60.0, clock=lambda: now[0])
    for i in range(10):
        rejections.refused(f"10.0.0.{i % 3}:{1000 + i}", f"reason {i}")
    assert len(records) == 2
    now[0] = 61.0
    rejections.refused("10.0.0.9:1", "late")  # a new window: the summary first, then this one
    assert records[2] == "refused 8 more unauthenticated connection(s) from 10.0.0.0, 10.0.0.1, 10.0.0.2; " \
                         "last reason: reason 9"
    assert records[3].startswith("refused unauthenticated connection from 10.0.0.9:1: late")
    assert rejections.total == 11
