"""The weight-update process group shared by trainer rank 0 and the engines.

Owns: building a torch.distributed group outside the default world, the way SGLang's engine side
does it (a TCP rendezvous at `tcp://master_address:master_port`, the store wrapped in
`PrefixStore(group_name, store)`, a fresh process group on that store). A plain
`dist.init_process_group` would use another key prefix and never meet the engines, so both sides
(the trainer's exporter and hpc_rl's CPU engine) call `init_weight_update_group`.
Rank 0 is the trainer (the broadcast source); engine i joins at `rank_offset_i`.
No Megatron import here: engines use it too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from hpc_rl.weights import DEFAULT_GROUP_NAME
from hpc_rl.weights.bound_store import bound_tcp_store
from hpc_rl.weights.device_identity import own_device_identity, publish_device, refuse_duplicate_devices


def init_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_seconds: float = 600.0,
    device_id: str | None = None,
    give_up: Callable[[], str] | None = None,
) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) the weight-update group; blocks until all `world_size` ranks joined, or, with
    `give_up`, until it answers why to stop waiting (WeightGroupJoinAbandoned; see `join_unless_given_up`).
    Two members on one device (`device_id`, default `own_device_identity()`) are refused, as NCCL does."""
    timeout = timedelta(seconds=timeout_seconds)
    # The TCPStore is built directly, not through `rendezvous("tcp://...")`: under torchrun that
    # handler (TORCHELASTIC_USE_AGENT_STORE) makes every rank, rank 0 included, a client of the
    # agent's store, so the trainer would never host the group. The raw store is the same either way.
    # Rank 0 hosts it on `master_address` only (torch alone would listen on every interface, unauthenticated).
    store = (bound_tcp_store(master_address, master_port, world_size, timeout=timeout) if rank == 0 else
             dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout))
    prefixed = dist.PrefixStore(group_name, store)
    publish_device(prefixed, rank, device_id or own_device_identity())

    def join() -> dist.ProcessGroup:
        group, _ = c10d._new_process_group_helper(
            world_size, rank, [], backend, prefixed, group_name=group_name, timeout=timeout
        )
        return group

    group = join() if give_up is None else join_unless_given_up(join, give_up, group_name)
    # Ranks of this group are its own (0..world_size-1): collectives take src=0 = the trainer.
    c10d._world.pg_group_ranks[group] = {index: index for index in range(world_size)}
    try:
        refuse_duplicate_devices(prefixed, rank, world_size)
    except Exception:
        dist.destroy_process_group(group)
        raise
    return group


JOIN_POLL_S = 0.5
"""How often rank 0 asks `give_up` while the members join."""


class WeightGroupJoinAbandoned(RuntimeError):
    """Rank 0 stopped waiting for the members of a weight-update group: one will never join (it died or failed
    before joining: the controller knows, from its failed init call)."""


def join_unless_given_up(join: Callable[[], dist.ProcessGroup], give_up: Callable[[], str],
                         group_name: str) -> dist.ProcessGroup:
    """`join()` on a thread of its own (the backend's rendezvous releases the GIL while it waits), asking
    `give_up()` every JOIN_POLL_S meanwhile. A member that never comes would hold rank 0 for the group's whole
    timeout (600 s); when `give_up()` says why, WeightGroupJoinAbandoned is raised at once and the join is left
    to end by itself (its timeout error is dropped; a group it still makes is destroyed), on a group name and
    port no later group uses. On NCCL the join itself returns at once (communicators are made at the first
    broadcast), so this bounds the gloo twin's wait; a lost engine there breaks the first broadcast instead."""
    outcome: dict[str, Any] = {}
    done = threading.Event()
    lock = threading.Lock()

    def run() -> None:
        try:
            group = join()
        except BaseException as error:  # noqa: BLE001 - read by the caller, or dropped once abandoned
            with lock:
                outcome["error"] = error
                done.set()
            return
        with lock:
            if outcome.get("abandoned"):
                destroy_weight_update_group(group)
            else:
                outcome["group"] = group
            done.set()

    threading.Thread(target=run, name=f"join {group_name}", daemon=True).start()
    while not done.wait(JOIN_POLL_S):
        reason = give_up()
        with lock:
            if reason and not done.is_set():
                outcome["abandoned"] = True
                raise WeightGroupJoinAbandoned(f"stopped waiting for the engines to join {group_name}: {reason}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["group"]


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    """Tear the group down (SGLang's /destroy_weights_update_group)."""
    dist.destroy_process_group(group)
