"""The weight-update group's store listens on the address given to the engines, not on every interface
(torch's TCPStore alone listens on all of them, without authentication)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from hpc_rl.weights.bound_store import bound_tcp_store
from hpc_rl.weights.process_group import destroy_weight_update_group, init_weight_update_group
from tests.listeners import listening_addresses


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_weight_update_store_listens_on_loopback_only() -> None:
    port = free_port()
    group = init_weight_update_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=1,
                                     group_name="test_store_binding", timeout_seconds=30)
    try:
        assert listening_addresses(port) == {"127.0.0.1"}  # the old code: {"::"} / {"0.0.0.0"}
    finally:
        destroy_weight_update_group(group)


def test_bound_store_serves_clients_on_its_address() -> None:
    server = bound_tcp_store("127.0.0.1", 0, 2, timeout=timedelta(seconds=10))
    port = server.port
    assert listening_addresses(port) == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
    server.set("key", "value")
    assert client.get("key") == b"value"
