"""Throughput of hpc_rl's controller protocol over loopback: small messages and 64 MiB float32 arrays.

The server (an echo/ack handler) runs in a child process, so client and server each have a core, as in
a job. Every phase is bounded in time; the whole run takes well under 30 s.

    python benchmarks/bench_protocol.py [--seconds 2.0] [--big-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import time

import numpy as np

from hpc_rl.protocol import BlockingClient, Connection, Envelope, Hello, Message, Secret, connect, serve
from hpc_rl.protocol.connection import envelope_from_frame, message_frame
from hpc_rl.protocol.framing import Direction, FrameCounter, frame_chunks, open_frame
from hpc_rl.protocol.messages import Arrays, CommandDone, Ping, Pong

SECRET = Secret(key=b"b" * 32, origin="<benchmark>")
HELLO = Hello(role="status")


async def _handler(conn: Connection, env: Envelope) -> Message | None:
    msg = env.message
    if isinstance(msg, Ping):
        return Pong(payload=msg.payload)
    if isinstance(msg, Arrays) and msg.meta.get("echo"):
        return msg
    if isinstance(msg, Arrays):
        return Pong(payload=str(sum(a.nbytes for a in msg.arrays.values())))
    return None


def _server_main(port_queue: mp.Queue[int]) -> None:
    async def main() -> None:
        server = await serve("127.0.0.1", 0, SECRET, _handler, max_frame_bytes=1 << 31)
        port_queue.put(server.port)
        await asyncio.Event().wait()

    asyncio.run(main())


class _Phase:
    """``while phase.more(): <calls>`` repeats the calls for `seconds` (at least once), then prints the rate."""

    def __init__(self, name: str, seconds: float, *, calls: int = 1, bytes_per_call: int = 0) -> None:
        self.name, self.seconds, self.calls, self.bytes_per_call = name, seconds, calls, bytes_per_call
        self.count, self.start = -calls, time.perf_counter()

    def more(self) -> bool:
        self.count += self.calls
        elapsed = time.perf_counter() - self.start
        if elapsed < self.seconds or self.count == 0:
            return True
        line = f"{self.name:<44} {self.count / elapsed:>10.1f} msg/s"
        if self.bytes_per_call:
            line += f"  {self.count * self.bytes_per_call / elapsed / 1e6:>9.1f} MB/s"
        print(line, flush=True)
        return False


async def _async_phases(port: int, seconds: float, big: np.ndarray) -> None:
    conn = await connect("127.0.0.1", port, SECRET, HELLO, max_frame_bytes=1 << 31)
    ping = Ping(payload="x" * 32)
    phase = _Phase("async request/reply, small (sequential)", seconds)
    while phase.more():
        await conn.request(ping)
    phase = _Phase("async request/reply, small (64 in flight)", seconds, calls=64)
    while phase.more():
        await asyncio.gather(*(conn.request(ping) for _ in range(64)))
    upload, echo = Arrays(arrays={"x": big}), Arrays(arrays={"x": big}, meta={"echo": True})
    phase = _Phase(f"async upload {big.nbytes >> 20} MiB float32 (+ack)", seconds, bytes_per_call=big.nbytes)
    while phase.more():
        await conn.request(upload)
    phase = _Phase(f"async echo {big.nbytes >> 20} MiB float32 (both ways)", seconds, bytes_per_call=2 * big.nbytes)
    while phase.more():
        reply = await conn.request(echo)
    assert isinstance(reply, Arrays) and reply.arrays["x"].shape == big.shape
    await conn.close()


def _blocking_phases(port: int, seconds: float, big: np.ndarray) -> None:
    with BlockingClient("127.0.0.1", port, SECRET, hello=HELLO, max_frame_bytes=1 << 31) as client:
        ping = Ping(payload="x" * 32)
        phase = _Phase("blocking request/reply, small", seconds)
        while phase.more():
            client.request(ping)
        upload, echo = Arrays(arrays={"x": big}), Arrays(arrays={"x": big}, meta={"echo": True})
        phase = _Phase(f"blocking upload {big.nbytes >> 20} MiB float32 (+ack)", seconds, bytes_per_call=big.nbytes)
        while phase.more():
            client.request(upload)
        phase = _Phase(f"blocking echo {big.nbytes >> 20} MiB float32 (both ways)", seconds,
                       bytes_per_call=2 * big.nbytes)
        while phase.more():
            client.request(echo)


def _encoding_only(seconds: float) -> None:
    """One small message through both ends in process (no socket): what serialization costs per message,
    and the share of it the JSON header takes (the part a faster JSON or msgpack library would speed up)."""
    done = CommandDone(rank=3, seq=17, metrics={"loss": 0.25, "grad_norm": 1.5, "lr": 1e-6, "tokens": 4096})
    sender, receiver = (FrameCounter(bytes(32), Direction.CLIENT_TO_SERVER) for _ in "sr")
    phase = _Phase("(reference) encode+MAC+verify+decode, small", seconds)
    while phase.more():
        header, parts = message_frame(done, id=1)
        wire = b"".join(frame_chunks(SECRET, sender, header, parts))
        framed, payload = open_frame(SECRET, receiver, wire[:20], bytearray(wire[20:]), int.from_bytes(wire[8:12]))
        envelope_from_frame(framed, payload)
    phase = _Phase("(reference) json header dumps+loads, small", seconds)
    while phase.more():
        json.loads(json.dumps(header, separators=(",", ":")))


def _hmac_only(big: np.ndarray) -> None:
    import hashlib
    import hmac

    start = time.perf_counter()
    hmac.new(SECRET.key, memoryview(big.reshape(-1).view(np.uint8)), hashlib.sha256).digest()
    elapsed = time.perf_counter() - start
    print(
        f"{'(reference) HMAC-SHA256 of the array alone':<44} {'':>16}  {big.nbytes / elapsed / 1e6:>9.1f} MB/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="duration of each phase")
    parser.add_argument("--big-mib", type=int, default=64, help="size of the large float32 array, MiB")
    args = parser.parse_args()

    big = np.random.default_rng(0).random((args.big_mib << 20) // 4, dtype=np.float32)
    ctx = mp.get_context("spawn")
    port_queue: mp.Queue[int] = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(port_queue,), daemon=True)
    server.start()
    try:
        port = port_queue.get(timeout=30)
        _hmac_only(big)
        _encoding_only(args.seconds)
        asyncio.run(_async_phases(port, args.seconds, big))
        _blocking_phases(port, args.seconds, big)
    finally:
        server.terminate()
        server.join(5)


if __name__ == "__main__":
    main()
