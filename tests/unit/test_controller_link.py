"""A trainer rank reaches a controller that starts after it (the driver starts both at once)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hpc_rl.engines.child_process import free_port
from hpc_rl.protocol import Server
from hpc_rl.protocol.secret import create_secret, secret_path
from hpc_rl.training.controller_link import ControllerLink, connect_when_listening


def test_a_rank_waits_for_the_controller_to_listen(tmp_path):
    secret = create_secret(secret_path(tmp_path))
    port = free_port()
    ready = threading.Event()
    stop = threading.Event()

    def serve_later() -> None:
        async def main() -> None:
            await asyncio.sleep(0.5)  # the rank has been refused a few times by now
            async def no_commands(connection, envelope):
                return None

            server = Server(secret, no_commands)
            await server.start("127.0.0.1", port)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await server.close()
        asyncio.run(main())

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()
    started = time.monotonic()
    link = ControllerLink(tmp_path, rank=0, world_size=1, info={}, address=f"127.0.0.1:{port}", timeout_s=10)
    try:
        assert ready.is_set() and time.monotonic() - started >= 0.5
        assert link.client.welcome is not None
    finally:
        link.close()
        stop.set()
        thread.join(5)


def test_a_controller_that_never_listens_is_named():
    calls = []

    def refused():
        calls.append(1)
        raise ConnectionRefusedError

    with pytest.raises(ConnectionRefusedError, match=r"controller at 10.0.0.1:5 refused connections for 0 s"):
        connect_when_listening(refused, "10.0.0.1:5", wait_s=0.2)
    assert len(calls) >= 2
