"""Throughput of hpc_rl's controller protocol over loopback: small messages and 64 MiB float32 arrays.

The server (an echo/ack handler) runs in a child process, so client and server each have a core, as in
a job. Every phase is bounded in time; the whole run takes well under 30 s.

    python benchmarks/bench_protocol.py [--seconds 2.0] [--big-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import numpy as np

from hpc_rl.protocol import (
    Arrays,
    BlockingClient,
    Connection,
    Envelope,
    Hello,
    Message,
    Ping,
    Pong,
    Secret,
    connect,
    serve,
)

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


def _report(name: str, count: int, seconds: float, nbytes: int = 0) -> None:
    line = f"{name:<44} {count / seconds:>10.1f} msg/s"
    if nbytes:
        line += f"  {nbytes / seconds / 1e6:>9.1f} MB/s"
    print(line, flush=True)


async def _async_phases(port: int, seconds: float, big: np.ndarray) -> None:
    conn = await connect("127.0.0.1", port, SECRET, HELLO, max_frame_bytes=1 << 31)
    ping = Ping(payload="x" * 32)

    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await conn.request(ping)
        count += 1
    _report("async request/reply, small (sequential)", count, time.perf_counter() - start)

    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await asyncio.gather(*(conn.request(ping) for _ in range(64)))
        count += 64
    _report("async request/reply, small (64 in flight)", count, time.perf_counter() - start)

    upload = Arrays(arrays={"x": big})
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or count == 0:
        await conn.request(upload)
        count += 1
    elapsed = time.perf_counter() - start
    _report(f"async upload {big.nbytes >> 20} MiB float32 (+ack)", count, elapsed, count * big.nbytes)

    echo = Arrays(arrays={"x": big}, meta={"echo": True})
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or count == 0:
        reply = await conn.request(echo)
        count += 1
    elapsed = time.perf_counter() - start
    assert isinstance(reply, Arrays) and reply.arrays["x"].shape == big.shape
    _report(f"async echo {big.nbytes >> 20} MiB float32 (both ways)", count, elapsed, 2 * count * big.nbytes)
    await conn.close()


def _blocking_phases(port: int, seconds: float, big: np.ndarray) -> None:
    with BlockingClient("127.0.0.1", port, SECRET, hello=HELLO, max_frame_bytes=1 << 31) as client:
        ping = Ping(payload="x" * 32)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            client.request(ping)
            count += 1
        _report("blocking request/reply, small", count, time.perf_counter() - start)

        upload = Arrays(arrays={"x": big})
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or count == 0:
            client.request(upload)
            count += 1
        elapsed = time.perf_counter() - start
        _report(f"blocking upload {big.nbytes >> 20} MiB float32 (+ack)", count, elapsed, count * big.nbytes)

        echo = Arrays(arrays={"x": big}, meta={"echo": True})
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or count == 0:
            client.request(echo)
            count += 1
        elapsed = time.perf_counter() - start
        _report(
            f"blocking echo {big.nbytes >> 20} MiB float32 (both ways)",
            count,
            elapsed,
            2 * count * big.nbytes,
        )


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
        asyncio.run(_async_phases(port, args.seconds, big))
        _blocking_phases(port, args.seconds, big)
    finally:
        server.terminate()
        server.join(5)


if __name__ == "__main__":
    main()
