"""Replay protection on 127.0.0.1: a man in the middle (``FrameTap``, a test fake that forwards frames and
can inject recorded ones) replays a real client's frames on a new connection, re-sends one on its own
connection and reflects frames back to their sender. Each is rejected with an error that names it, the
connection is closed, and the server keeps serving others; untouched traffic through the tap still works."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from hpc_rl.protocol import framing
from hpc_rl.protocol.blocking import BlockingClient
from hpc_rl.protocol.connection import connect, read_envelope
from hpc_rl.protocol.errors import BadMacError, ProtocolError, RemoteError
from hpc_rl.protocol.messages import ErrorReply, Ping, Pong, ServerHello
from hpc_rl.protocol.server import Server
from tests.unit.test_protocol_server import HELLO, SECRET, assert_still_serving, run_with_server
from tests.unit.waiting import wait_until


class TappedConnection:
    """One proxied connection: the frames seen each way, and the writers to inject more."""

    def __init__(self, client_writer: asyncio.StreamWriter, server_writer: asyncio.StreamWriter) -> None:
        self.to_server: list[bytes] = []
        self.to_client: list[bytes] = []
        self.client_writer, self.server_writer = client_writer, server_writer

    async def inject_to_server(self, frame: bytes) -> None:
        self.server_writer.write(frame)
        await self.server_writer.drain()

    async def inject_to_client(self, frame: bytes) -> None:
        self.client_writer.write(frame)
        await self.client_writer.drain()


class FrameTap:
    """A TCP proxy in front of the server that records every frame per direction, whole, and can inject
    recorded frames into either direction of a live connection (``tap.last``: the newest one)."""

    def __init__(self, server_port: int) -> None:
        self.server_port = server_port
        self.connections: list[TappedConnection] = []
        self._listener: asyncio.base_events.Server | None = None
        self._pumps: list[asyncio.Task[None]] = []

    @property
    def last(self) -> TappedConnection:
        return self.connections[-1]

    async def start(self) -> int:
        self._listener = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        return self._listener.sockets[0].getsockname()[1]

    async def _on_client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.server_port)
        tapped = TappedConnection(c_writer, s_writer)
        self.connections.append(tapped)
        self._pumps += [
            asyncio.create_task(self._pump(c_reader, s_writer, tapped.to_server)),
            asyncio.create_task(self._pump(s_reader, c_writer, tapped.to_client)),
        ]

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: list[bytes]) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                prefix = await reader.readexactly(framing.PREFIX.size)
                _, _, _, header_len, payload_len = framing.PREFIX.unpack(prefix)
                frame = prefix + await reader.readexactly(header_len + payload_len + framing.MAC_BYTES)
                record.append(frame)
                writer.write(frame)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for tapped in self.connections:
            tapped.client_writer.close()
            tapped.server_writer.close()
        if self._listener is not None:
            self._listener.close()
            await self._listener.wait_closed()


def run_with_tap(scenario: Callable[[Server, FrameTap, int], Awaitable[None]]) -> None:
    async def with_tap(server: Server) -> None:
        tap = FrameTap(server.port)
        port = await tap.start()
        try:
            await scenario(server, tap, port)
        finally:
            await tap.close()

    run_with_server(with_tap)


async def send_raw_and_read_rejection(port: int, frames: list[bytes]) -> str:
    """On a fresh connection: read the server hello, send ``frames`` as they are, return the ErrorReply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    hello = await read_envelope(reader, SECRET, framing.FrameCounter.server_hello())
    assert isinstance(hello.message, ServerHello)
    _, incoming = framing.session_counters(bytes.fromhex(hello.message.nonce), server=False)
    writer.write(b"".join(frames))
    await writer.drain()
    env = await read_envelope(reader, SECRET, incoming)
    assert isinstance(env.message, ErrorReply)
    assert await reader.read() == b""  # the server closed this connection
    writer.close()
    return env.message.message


def test_captured_frames_replayed_on_a_new_connection_are_rejected() -> None:
    async def scenario(server: Server, tap: FrameTap, port: int) -> None:
        victim = await connect("127.0.0.1", port, SECRET, HELLO)
        assert await victim.request(Ping(payload="secret work")) == Pong(payload="secret work")
        await victim.close()
        assert len(tap.last.to_server) == 2  # Hello, Ping
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        text = await send_raw_and_read_rejection(server.port, tap.last.to_server)
        assert "bad MAC" in text and "replayed from another connection" in text
        text = await send_raw_and_read_rejection(server.port, tap.last.to_server[1:])  # skipping the Hello
        assert "bad MAC" in text
        await assert_still_serving(good, server)
        await good.close()

    run_with_tap(scenario)


@pytest.mark.parametrize(("stream", "index", "why"), [
    ("to_server", 1, r"replayed or reordered frame: it is frame #1 of this connection's client->server stream, "
                     r"but #2 was due"),
    ("to_client", 2, r"reflected frame: it is frame #1 of this connection's server->client stream"),
], ids=["ping-resent", "pong-reflected"])
def test_frame_resent_or_reflected_to_the_server_is_rejected(stream: str, index: int, why: str) -> None:
    """The Ping again on its own connection (client->server #1 where #2 is due), or the Pong (server->client
    #1) sent back to the server: the victim's connection is closed with the cause, others keep working."""

    async def scenario(server: Server, tap: FrameTap, port: int) -> None:
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        victim = await connect("127.0.0.1", port, SECRET, HELLO)
        assert await victim.request(Ping(payload="once")) == Pong(payload="once")
        assert len(tap.last.to_client) == 3  # ServerHello, Welcome, Pong
        await tap.last.inject_to_server(getattr(tap.last, stream)[index])
        with pytest.raises(RemoteError, match=why):
            await victim.request(Ping(payload="twice"))
        await wait_until(lambda: len(server.connections) == 1)
        await assert_still_serving(good, server)
        await victim.close()
        await good.close()

    run_with_tap(scenario)


def test_client_frame_reflected_to_the_async_client_is_rejected() -> None:
    async def scenario(server: Server, tap: FrameTap, port: int) -> None:
        victim = await connect("127.0.0.1", port, SECRET, HELLO)
        assert await victim.request(Ping(payload="p")) == Pong(payload="p")
        await tap.last.inject_to_client(tap.last.to_server[1])  # the client's own Ping (client->server #1)
        with pytest.raises(
            BadMacError,
            match=r"reflected frame: it is frame #1 of this connection's "
            r"client->server stream",
        ):
            await victim.recv()
        with pytest.raises(ProtocolError):
            await victim.request(Ping(payload="after"))
        await victim.close()

    run_with_tap(scenario)


def test_blocking_client_rejects_replayed_and_reflected_frames() -> None:
    async def scenario(server: Server, tap: FrameTap, port: int) -> None:
        loop = asyncio.get_running_loop()

        def inject_to_client(frame: bytes) -> None:  # from the client's thread, into the tap's loop
            asyncio.run_coroutine_threadsafe(tap.last.inject_to_client(frame), loop).result(5)

        def replayed() -> None:
            with BlockingClient("127.0.0.1", port, SECRET, hello=HELLO, timeout=5) as client:
                assert client.request(Ping(payload="a")) == Pong(payload="a")
                inject_to_client(tap.last.to_client[-1])  # the Pong again (server->client #1, #2 is due)
                with pytest.raises(BadMacError, match="frame #1 .*server->client stream, but #2 was due"):
                    client.request(Ping(payload="b"))

        await asyncio.to_thread(replayed)

        def reflected() -> None:
            with BlockingClient("127.0.0.1", port, SECRET, hello=HELLO, timeout=5) as client:
                assert client.request(Ping(payload="c")) == Pong(payload="c")
                inject_to_client(tap.last.to_server[0])  # its own Hello (client->server #0)
                with pytest.raises(BadMacError, match="reflected frame: it is frame #0 .*client->server"):
                    client.request(Ping(payload="d"))

        await asyncio.to_thread(reflected)
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        await assert_still_serving(good, server)
        await good.close()

    run_with_tap(scenario)


def test_normal_traffic_through_the_tap_and_fresh_nonces() -> None:
    async def scenario(server: Server, tap: FrameTap, port: int) -> None:
        conn = await connect("127.0.0.1", port, SECRET, HELLO)
        replies = await asyncio.gather(*(conn.request(Ping(payload=str(i))) for i in range(20)))
        assert [r.payload for r in replies] == [str(i) for i in range(20)]  # type: ignore[attr-defined]
        other = await connect("127.0.0.1", server.port, SECRET, HELLO)
        assert conn.nonce is not None and other.nonce is not None and conn.nonce != other.nonce
        (server_side,) = [c for c in server.connections.values() if c.nonce == conn.nonce]
        assert server_side.nonce == conn.nonce
        await conn.close()
        await other.close()

    run_with_tap(scenario)
