"""The authenticated server on 127.0.0.1: each kind of bad peer is rejected with a clear error and its
connection closed, while a good client connected at the same time keeps getting answers."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from hpc_rl.protocol import framing
from hpc_rl.protocol.blocking import BlockingClient
from hpc_rl.protocol.connection import Connection, Envelope, connect, message_frame, read_envelope
from hpc_rl.protocol.errors import BadMacError, HandshakeError, PeerClosedError, ProtocolError, RemoteError
from hpc_rl.protocol.messages import (Arrays, ErrorReply, Hello, Message, Ping, Pong, ServerHello, Shutdown,
                                      StatusRequest)
from hpc_rl.protocol.secret import Secret
from hpc_rl.protocol.server import Server, serve
from tests.unit.protocol_frames import encode_frame
from tests.unit.waiting import wait_until

SECRET = Secret(key=b"k" * 32, origin="/run/job/secret")
WRONG = Secret(key=b"x" * 32, origin="/elsewhere/secret")


async def echo_handler(conn: Connection, env: Envelope) -> Message | None:
    msg = env.message
    if isinstance(msg, Ping):
        return Pong(payload=msg.payload)
    if isinstance(msg, StatusRequest):
        raise RuntimeError("status is broken")
    return msg  # arrays and the rest: echo


def run_with_server(scenario: Callable[[Server], Awaitable[None]], **options: object) -> None:
    async def main() -> None:
        server = await serve("127.0.0.1", 0, SECRET, echo_handler, **{"handshake_timeout": 1.0, **options})
        try:
            await asyncio.wait_for(scenario(server), 8)
        finally:
            await server.close()

    asyncio.run(main())


async def raw_attempt(
    port: int, make: Callable[[framing.FrameCounter], bytes], *, eof: bool = True
) -> str | None:
    """Read the server hello, send ``make(counter of this connection's client->server frames)``; return
    the server's ErrorReply text (None if none arrived) and check it closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    server_hello = await read_envelope(reader, SECRET, framing.FrameCounter.server_hello())
    assert isinstance(server_hello.message, ServerHello)
    outgoing, incoming = framing.session_counters(bytes.fromhex(server_hello.message.nonce), server=False)
    writer.write(make(outgoing))
    if eof:
        writer.write_eof()
    await writer.drain()
    try:
        env = await read_envelope(reader, SECRET, incoming)
        assert env.reply_to is None
        assert isinstance(env.message, ErrorReply)
        text: str | None = env.message.message
    except (PeerClosedError, ConnectionError):
        text = None
    assert await reader.read() == b""  # the server closed this connection
    writer.close()
    return text


async def assert_still_serving(good: Connection, server: Server) -> None:
    assert await good.request(Ping(payload="still here")) == Pong(payload="still here")
    fresh = await connect("127.0.0.1", server.port, SECRET, Hello(role="status"))
    assert await fresh.request(Ping(payload="new")) == Pong(payload="new")
    await fresh.close()


def frame_bytes(msg: Message, counter: framing.FrameCounter, secret: Secret = SECRET, id: int = 1) -> bytes:
    header, parts = message_frame(msg, id=id)
    return encode_frame(secret, counter, header, parts)


HELLO = Hello(role="trainer", rank=0, world_size=2, host="h", pid=1)
V = framing.PROTOCOL_VERSION

BAD_PEERS: dict[str, tuple[Callable[[framing.FrameCounter], bytes], str]] = {
    "garbage": (lambda c: bytes(range(256)) * 4, "not an hpc_rl frame"),
    "http": (lambda c: b"GET /generate HTTP/1.1\r\nHost: x\r\n\r\n", "looks like HTTP"),
    "wrong_version": (
        lambda c: struct.pack("!4sH", framing.MAGIC, V + 1) + frame_bytes(HELLO, c)[6:],
        f"protocol version mismatch: the peer sent frame format v{V + 1}, this side speaks v{V}",
    ),
    "oversized": (
        lambda c: framing.PREFIX.pack(framing.MAGIC, V, 0, 100, 1 << 40) + b"x" * 1000,
        "rejected before reading it",
    ),
    "first_frame_not_hello": (
        lambda c: frame_bytes(Ping(payload="sneaky"), c),
        "first message must be 'hello', got 'ping'",
    ),
    "wrong_secret": (
        lambda c: frame_bytes(HELLO, c, WRONG),
        "bad MAC: the peer does not hold this job's secret",
    ),
    "truncated": (lambda c: frame_bytes(HELLO, c)[:-10], "connection closed after"),
    "truncated_prefix": (lambda c: frame_bytes(HELLO, c)[:7], "7 of the 20 bytes of a frame prefix"),
}


@pytest.mark.parametrize("case", list(BAD_PEERS))
def test_bad_peer_rejected_and_server_unaffected(case: str, caplog: pytest.LogCaptureFixture) -> None:
    make, expected = BAD_PEERS[case]

    async def scenario(server: Server) -> None:
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        assert await good.request(Ping(payload="before")) == Pong(payload="before")
        text = await raw_attempt(server.port, make)
        assert text is not None and expected in text
        await assert_still_serving(good, server)
        await wait_until(lambda: len(server.connections) == 1)  # only the good one is left
        await good.close()

    with caplog.at_level(logging.WARNING, logger="hpc_rl.protocol"):
        run_with_server(scenario)
    assert any(expected in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_silent_client_times_out_at_handshake(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(server: Server) -> None:
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        text = await raw_attempt(server.port, lambda c: b"", eof=False)  # connects, says nothing
        assert text is not None and "no Hello within 0.3 s" in text
        await assert_still_serving(good, server)
        await good.close()

    with caplog.at_level(logging.WARNING, logger="hpc_rl.protocol"):
        run_with_server(scenario, handshake_timeout=0.3)


def test_wrong_secret_client_gets_a_clear_error() -> None:
    async def scenario(server: Server) -> None:
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        with pytest.raises(BadMacError, match=r"does not hold this job's secret \(/elsewhere/secret\)"):
            await connect("127.0.0.1", server.port, WRONG, HELLO)
        await assert_still_serving(good, server)
        await good.close()

    run_with_server(scenario)


def test_oversized_frame_after_handshake_closes_only_that_connection() -> None:
    async def scenario(server: Server) -> None:
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        greedy = await connect("127.0.0.1", server.port, SECRET, HELLO)
        with pytest.raises(RemoteError, match="exceeds the limit of 65536 bytes"):
            await greedy.request(Arrays(arrays={"big": np.zeros(1 << 15, dtype=np.float32)}))
        with pytest.raises(ProtocolError):
            await greedy.request(Ping())
        small = np.arange(100, dtype=np.float32)
        echoed = await good.request(Arrays(arrays={"small": small}))
        assert isinstance(echoed, Arrays)
        np.testing.assert_array_equal(echoed.arrays["small"], small)
        await assert_still_serving(good, server)
        await good.close()
        await greedy.close()

    run_with_server(scenario, max_frame_bytes=1 << 16)


def test_huge_upload_rejected_mid_write_still_says_why() -> None:
    big = np.zeros(16 << 20, dtype=np.uint8)  # the server stops reading long before the client is done

    async def scenario(server: Server) -> None:
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        greedy = await connect("127.0.0.1", server.port, SECRET, HELLO)
        with pytest.raises(RemoteError, match="exceeds the limit of 65536 bytes"):
            await greedy.request(Arrays(arrays={"big": big}))

        def blocking_greedy() -> None:
            with BlockingClient("127.0.0.1", server.port, SECRET, hello=HELLO, timeout=5) as client:
                with pytest.raises(RemoteError, match="exceeds the limit of 65536 bytes"):
                    client.request(Arrays(arrays={"big": big}))

        await asyncio.to_thread(blocking_greedy)
        await assert_still_serving(good, server)
        await good.close()
        await greedy.close()

    run_with_server(scenario, max_frame_bytes=1 << 16)


def test_handler_error_is_an_error_reply_not_a_disconnect() -> None:
    async def scenario(server: Server) -> None:
        good = await connect("127.0.0.1", server.port, SECRET, HELLO)
        with pytest.raises(RemoteError, match="RuntimeError: status is broken"):
            await good.request(StatusRequest())
        assert await good.request(Ping(payload="ok")) == Pong(payload="ok")
        await good.close()

    run_with_server(scenario)


def test_on_hello_can_refuse_a_peer_and_welcome_carries_info() -> None:
    async def on_hello(conn: Connection, hello: Hello) -> dict:
        if hello.role == "engine" and "url" not in hello.info:
            raise HandshakeError("an engine must say its url in Hello.info")
        return {"you_are": hello.role}

    async def scenario(server: Server) -> None:
        with pytest.raises(RemoteError, match="must say its url"):
            await connect("127.0.0.1", server.port, SECRET, Hello(role="engine"))
        conn = await connect("127.0.0.1", server.port, SECRET, Hello(role="engine", info={"url": "http://e"}))
        assert conn.welcome is not None and conn.welcome.info == {"you_are": "engine"}
        await conn.close()

    run_with_server(scenario, on_hello=on_hello)


def test_concurrent_requests_are_matched_and_server_can_push() -> None:
    async def scenario(server: Server) -> None:
        conn = await connect("127.0.0.1", server.port, SECRET, HELLO)
        replies = await asyncio.gather(*(conn.request(Ping(payload=str(i))) for i in range(50)))
        assert [r.payload for r in replies] == [str(i) for i in range(50)]  # type: ignore[attr-defined]
        (server_side,) = server.connections.values()
        assert server_side.hello == HELLO
        await server_side.send(Shutdown(reason="done"))
        pushed = await conn.recv()
        assert pushed.message == Shutdown(reason="done") and pushed.reply_to is None
        await conn.close()

    run_with_server(scenario)


def test_blocking_client_round_trip() -> None:
    async def scenario(server: Server) -> None:
        def blocking() -> None:
            with BlockingClient("127.0.0.1", server.port, SECRET, hello=HELLO, timeout=5) as client:
                assert client.welcome.connection_id >= 1
                assert client.request(Ping(payload="b")) == Pong(payload="b")
                data = np.random.default_rng(1).random((128, 64)).astype(np.float32)
                echoed = client.request(Arrays(arrays={"d": data}, meta={"step": 3}))
                assert isinstance(echoed, Arrays) and echoed.meta == {"step": 3}
                np.testing.assert_array_equal(echoed.arrays["d"], data)
                with pytest.raises(RemoteError, match="status is broken"):
                    client.request(StatusRequest())
                assert client.request(Ping(payload="after")) == Pong(payload="after")

        await asyncio.to_thread(blocking)

        def wrong_secret() -> None:
            with pytest.raises(BadMacError, match="/elsewhere/secret"):
                BlockingClient("127.0.0.1", server.port, WRONG, timeout=5)

        await asyncio.to_thread(wrong_secret)

    run_with_server(scenario)


def test_blocking_client_refused_by_a_non_hpc_rl_port() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    async def http_like_server() -> None:
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(listener)
        await loop.sock_sendall(conn, b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    async def main() -> None:
        listener.setblocking(False)
        task = asyncio.create_task(http_like_server())
        with pytest.raises(ProtocolError, match="not an hpc_rl frame"):
            await asyncio.to_thread(BlockingClient, "127.0.0.1", port, SECRET, timeout=5)
        await task

    try:
        asyncio.run(main())
    finally:
        listener.close()


def test_a_payload_of_several_write_slices_comes_back_intact() -> None:
    """Connection._write hands big arrays to the transport in WRITE_SLICE_BYTES slices; both directions of
    an echo go through it: every byte must arrive, in order (the MAC checks the frame, this the content)."""
    from hpc_rl.protocol.connection import WRITE_SLICE_BYTES

    values = (np.arange(WRITE_SLICE_BYTES, dtype=np.int64) * 2654435761) % 1_000_003  # 8 MiB, not constant
    odd = np.arange(WRITE_SLICE_BYTES // 3 + 7, dtype=np.float32)  # ends mid-slice

    async def scenario(server: Server) -> None:
        client = await connect("127.0.0.1", server.port, SECRET, HELLO)
        echoed = await client.request(Arrays(arrays={"values": values, "odd": odd}))
        assert isinstance(echoed, Arrays)
        np.testing.assert_array_equal(echoed.arrays["values"], values)
        np.testing.assert_array_equal(echoed.arrays["odd"], odd)
        await client.close()

    run_with_server(scenario)
