"""Big frames' MACs from the frame signer process (protocol/frame_signer.py): the bytes on the wire are the
in-process frame's byte for byte; a signer that dies, hangs or cannot start costs no frame (signed in process,
said once in the log); the ring and the process are gone after close."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpc_rl.protocol import framing
from hpc_rl.protocol.connection import Connection, connect, message_frame
from hpc_rl.protocol.frame_signer import FrameSigner
from hpc_rl.protocol.messages import Arrays, Hello
from hpc_rl.protocol.secret import Secret
from hpc_rl.protocol.server import Server, serve
from tests.unit.waiting import wait_until

SECRET = Secret(key=b"s" * 32, origin="/run/job/secret")
HELLO = Hello(role="status")
PAGE = 4096


def big_arrays(seed: int = 0, nbytes: int = 3 << 20) -> dict[str, np.ndarray]:
    """Not constant, with odd sizes (pads between arrays), several ring chunks long."""
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, 150_000, nbytes // 8, dtype=np.int64),
            "logprobs": rng.standard_normal(nbytes // 16 + 3).astype(np.float32),
            "mask": np.ones(1001, dtype=np.uint8)}


async def echo(conn: Connection, env: Any) -> Any:
    return env.message


async def with_server(signer: FrameSigner, scenario: Any) -> None:
    server = await serve("127.0.0.1", 0, SECRET, echo, signer=signer)
    try:
        await asyncio.wait_for(scenario(server), 60)
    finally:
        await server.close()
        await signer.close()


async def echo_round(server: Server, arrays: dict[str, np.ndarray]) -> None:
    client = await connect("127.0.0.1", server.port, SECRET, HELLO)
    try:
        reply = await client.request(Arrays(arrays=arrays, meta={"n": 1}))
        assert isinstance(reply, Arrays)  # (the client verified its MAC)
        for name, values in arrays.items():
            np.testing.assert_array_equal(reply.arrays[name], values)
    finally:
        await client.close()


def signer_fds() -> list[str]:
    """This process's fds and mappings of the signer's ring (a memfd)."""
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [line for line in fds + maps if "hpc_rl-frame-signer" in line]


def test_signed_frame_is_the_in_process_frame_byte_for_byte() -> None:
    """The same message on two connections with the same nonce: one signed here, one by the signer (small
    ring: several frames wait for chunks); the wire bytes are equal."""
    arrays = big_arrays()

    async def send_one(signer: FrameSigner | None) -> bytes:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        conn = Connection(reader, writer, SECRET, signer=signer)
        conn._bind(b"n" * framing.NONCE_BYTES, server=True)
        peer_reader, peer_writer = await asyncio.open_unix_connection(sock=theirs)
        reading = asyncio.create_task(peer_reader.read())
        await conn.send(Arrays(arrays=arrays, meta={"x": 1.5}))
        writer.close()
        wire = await reading
        peer_writer.close()
        return wire

    async def main() -> None:
        signer = FrameSigner(SECRET, chunk_bytes=64 * PAGE, chunks=2)
        try:
            here = await send_one(None)
            there = await send_one(signer)
            assert signer.signed == 1
        finally:
            await signer.close()
        assert there == here
        header, parts = message_frame(Arrays(arrays=arrays, meta={"x": 1.5}), id=1)
        counter = framing.session_counters(b"n" * framing.NONCE_BYTES, server=True)[0]
        expected = b"".join(bytes(c) for c in framing.frame_chunks(SECRET, counter, header, parts))
        assert here == expected

    asyncio.run(main())


def test_concurrent_big_frames_share_a_small_ring_and_all_verify() -> None:
    signer = FrameSigner(SECRET, chunk_bytes=16 * PAGE, chunks=3)

    async def scenario(server: Server) -> None:
        await asyncio.gather(*(echo_round(server, big_arrays(seed)) for seed in range(4)))
        assert signer.signed == 4 and signer.lost is None and signer.pid is not None

    asyncio.run(with_server(signer, scenario))


def test_small_frames_are_signed_in_process_and_start_no_signer() -> None:
    signer = FrameSigner(SECRET)

    async def scenario(server: Server) -> None:
        await echo_round(server, {"small": np.arange(1000, dtype=np.int64)})
        assert signer.process is None and signer.signed == 0

    asyncio.run(with_server(signer, scenario))


def test_a_killed_signer_falls_back_to_signing_in_process(caplog: pytest.LogCaptureFixture) -> None:
    signer = FrameSigner(SECRET, chunk_bytes=16 * PAGE, chunks=2)

    async def scenario(server: Server) -> None:
        await echo_round(server, big_arrays(1))
        assert signer.signed == 1
        pid = signer.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await echo_round(server, big_arrays(2))  # lost as it is noticed or before: signed here, no frame lost
        await echo_round(server, big_arrays(3))
        assert signer.lost is not None and signer.signed == 1 and signer.pid is None
        assert signer_fds() == [], "the ring is released as soon as the signer is lost"

    with caplog.at_level(logging.WARNING, logger="hpc_rl.protocol"):
        asyncio.run(with_server(signer, scenario))
    said = [r.getMessage() for r in caplog.records if "frame signer" in r.getMessage()]
    assert len(said) == 1 and "computed in the controller process from now on" in said[0], said


def test_a_signer_that_dies_mid_frame_costs_no_frame(caplog: pytest.LogCaptureFixture) -> None:
    """Stopped (SIGSTOP) while frames are being fed to it: after stall_timeout_s it is given up (killed), and
    the frames in flight get their MACs here."""
    signer = FrameSigner(SECRET, chunk_bytes=16 * PAGE, chunks=2, stall_timeout_s=1.0)

    async def scenario(server: Server) -> None:
        await echo_round(server, big_arrays(1))  # started and working
        pid = signer.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        await asyncio.gather(echo_round(server, big_arrays(2)), echo_round(server, big_arrays(3)))
        assert signer.lost is not None and "1 s" in signer.lost
        # killed, reaped by Popen.poll in _lose or close
        await wait_until(lambda: signer.process is not None and signer.process.poll() is not None,
                         what="the signer reaped")
        assert signer.process is not None and signer.process.returncode == -signal.SIGKILL

    with caplog.at_level(logging.WARNING, logger="hpc_rl.protocol"):
        asyncio.run(with_server(signer, scenario))
    assert sum("frame signer" in r.getMessage() for r in caplog.records) == 1


def test_a_signer_that_cannot_start_falls_back(caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    signer = FrameSigner(SECRET)
    monkeypatch.setattr("hpc_rl.protocol.frame_signer.sys.executable", "/nonexistent/python")

    async def scenario(server: Server) -> None:
        await echo_round(server, big_arrays(4))
        assert signer.lost is not None and "could not start" in signer.lost and signer.signed == 0

    with caplog.at_level(logging.WARNING, logger="hpc_rl.protocol"):
        asyncio.run(with_server(signer, scenario))
    assert any("could not start" in r.getMessage() for r in caplog.records)
    assert signer_fds() == []


def test_close_ends_the_signer_and_releases_the_ring() -> None:
    signer = FrameSigner(SECRET, chunk_bytes=16 * PAGE, chunks=2)

    async def scenario(server: Server) -> None:
        await echo_round(server, big_arrays(5))
        assert signer_fds(), "the ring is mapped while the signer runs"

    asyncio.run(with_server(signer, scenario))
    assert signer.process is not None and signer.process.poll() is not None
    assert signer_fds() == []


def test_an_abandoned_frame_leaves_the_ring_usable() -> None:
    """A send cancelled mid-frame (its caller gave up) while its payload waits for ring chunks: its job is
    dropped, its chunks come back once the signer hashed them, and the next frame is signed there."""
    signer = FrameSigner(SECRET, chunk_bytes=16 * PAGE, chunks=2)

    async def scenario(server: Server) -> None:
        await echo_round(server, big_arrays(6))
        pid = signer.pid
        assert pid is not None
        client = await connect("127.0.0.1", server.port, SECRET, HELLO)
        client.writer.transport.pause_reading()  # the frame stalls once the socket buffers are full
        conn = next(iter(server.connections.values()))
        os.kill(pid, signal.SIGSTOP)  # the ring's two chunks stay full
        try:
            sending = asyncio.create_task(conn.send(Arrays(arrays=big_arrays(7, 64 << 20))))
            await wait_until(lambda: len(signer._jobs) == 1 and signer._free == [],
                             what="the frame's job holding both chunks")
            assert not sending.done()
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
            assert signer._jobs == {}
        finally:
            os.kill(pid, signal.SIGCONT)
        await client.close()
        await echo_round(server, big_arrays(8))
        assert signer.lost is None and signer.signed == 2 and signer._jobs == {}
        assert sorted(signer._free) == [0, 1]

    asyncio.run(with_server(signer, scenario))


def test_a_failure_feeding_the_signer_costs_no_frame(caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug on the controller's side of the signer (a fake one here: feeding raises) still sends the frame,
    signed in process, and stops using the signer."""
    signer = FrameSigner(SECRET, chunk_bytes=16 * PAGE, chunks=2)

    async def broken_feed(job: Any, frame: Any) -> None:
        raise RuntimeError("fake feeding bug")

    async def scenario(server: Server) -> None:
        await echo_round(server, big_arrays(9))
        monkeypatch.setattr(signer, "_feed", broken_feed)
        await echo_round(server, big_arrays(10))
        assert signer.lost is not None and "fake feeding bug" in signer.lost and signer.signed == 1

    with caplog.at_level(logging.WARNING, logger="hpc_rl.protocol"):
        asyncio.run(with_server(signer, scenario))
    assert any("computed in the controller process from now on" in r.getMessage() for r in caplog.records)
