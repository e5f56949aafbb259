"""A weight-update group with two members on one device is refused on the gloo path, as NCCL refuses it
("Duplicate GPU detected"); members on different devices join."""

from __future__ import annotations

import multiprocessing

import pytest

from hpc_rl.process.child_process import free_port
from hpc_rl.weights.device_identity import device_identity
from hpc_rl.weights.process_group import destroy_weight_update_group, init_weight_update_group


def _member(port: int, rank: int, device: str, group_name: str, results) -> None:
    from hpc_rl.weights.process_group import init_weight_update_group

    try:
        group = init_weight_update_group(master_address="127.0.0.1", master_port=port, rank=rank, world_size=2,
                                         group_name=group_name, backend="gloo", timeout_seconds=60, device_id=device)
        destroy_weight_update_group(group)
        results.put((rank, "joined", ""))
    except Exception as error:  # noqa: BLE001 - the test reads it
        results.put((rank, type(error).__name__, str(error)))


def join_both(devices: list[str], group_name: str) -> dict[int, tuple[str, str]]:
    """Two member processes (a group name is registered once per process, as on the trainer and an engine)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    members = [context.Process(target=_member, args=(port, rank, devices[rank], group_name, results))
               for rank in range(2)]
    for member in members:
        member.start()
    outcomes = {}
    for _ in members:
        rank, kind, message = results.get(timeout=120)
        outcomes[rank] = (kind, message)
    for member in members:
        member.join(30)
    return outcomes


@pytest.mark.slow
def test_two_members_on_one_device_are_refused_on_both_sides() -> None:
    same = device_identity("node0", 0)
    outcomes = join_both([same, same], "dup_test")
    for kind, message in outcomes.values():
        assert kind == "DuplicateDeviceError", message
        assert "Duplicate GPU detected: rank 1 and rank 0" in message and "node0/gpu0" in message


@pytest.mark.slow
def test_members_on_different_devices_join() -> None:
    outcomes = join_both([device_identity("node0", 0),
                          device_identity("node1", 0)], "distinct_test")
    assert outcomes == {0: ("joined", ""), 1: ("joined", "")}
