"""TCPStore servers that listen on one address, not on every interface.

Owns `bound_tcp_store`: torch's TCPStore server listens on all interfaces whatever host it is given
(measured, torch 2.13: `ss -ltn` shows `*:PORT` for `TCPStore("127.0.0.1", ..., is_master=True)`), and
it has no authentication: anyone who reaches the port reads and writes its keys. Handing it a socket
already bound to the wanted address (`master_listen_fd`) is the one way torch offers to narrow that.
Used by the weight-update group (trainer rank 0 hosts its store on the address it gives the engines) and
by `hpc_rl.launch.bound_torchrun` (torchrun's rendezvous stores, loopback in a local run).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket bound to (address, port) and listening (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def bound_tcp_store(address: str, port: int, world_size: int | None, *, timeout: timedelta,
                    wait_for_workers: bool = False, multi_tenant: bool = False) -> dist.TCPStore:
    """A TCPStore server listening on `address` only (the store keeps the socket open while it lives)."""
    sock = listening_socket(address, port)
    try:
        return dist.TCPStore(address, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                             master_listen_fd=sock.detach())
    except BaseException:
        sock.close()
        raise
