"""`python -m hpc_rl.launch.bound_torchrun ARGS`: torchrun (same ARGS) whose stores listen on one address.

Owns narrowing torchrun's two TCPStore servers, the c10d rendezvous store (at `--rdzv-endpoint`) and the
store it shares with its worker ranks, to the address in `STORE_ADDRESS_ENV` (the driver sets 127.0.0.1
for a local run). torch gives neither a bind address: they would listen on every interface without
authentication (see `hpc_rl.weights.bound_store`). Without the variable this is plain torchrun (a
multi-node trainer needs its stores reachable from the other nodes; see the README's "What listens").
Also owns that no process of a rank outlives the agent: it is a child subreaper, and ends what a dead
rank left behind (`hpc_rl.launch.orphans`) before it exits.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from hpc_rl.launch.orphans import become_subreaper, end_children

STORE_ADDRESS_ENV = "HPC_RL_STORE_ADDRESS"


def _bind_store_servers(address: str) -> None:
    """Every TCPStore server torchrun creates in this process listens on `address` only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    from hpc_rl.weights.bound_store import listening_socket

    class AddressBoundTCPStore(dist.TCPStore):  # a subclass, so torch's isinstance checks still hold
        def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                     timeout: timedelta = timedelta(seconds=300), wait_for_workers: bool = True,
                     multi_tenant: bool = False, master_listen_fd: int | None = None,
                     use_libuv: bool = True) -> None:
            if is_master and master_listen_fd is None:
                sock = listening_socket(address, port)
                port, master_listen_fd = sock.getsockname()[1], sock.detach()
            super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                             master_listen_fd, use_libuv)

    dist.TCPStore = AddressBoundTCPStore  # type: ignore[misc]  (dynamic_rendezvous reads dist.TCPStore)
    c10d_rendezvous_backend.TCPStore = AddressBoundTCPStore  # type: ignore[misc]  (imported by name there)


def main() -> None:
    address = os.environ.get(STORE_ADDRESS_ENV)
    if address:
        _bind_store_servers(address)
    from torch.distributed.run import main as torchrun_main

    from torch.distributed.elastic.multiprocessing.api import SignalException

    become_subreaper()  # a dead rank's children (Megatron's checkpoint writer's helpers) come to us
    try:
        torchrun_main()  # raises when a rank failed, or on SIGTERM (torchrun then stops every rank first)
    except SignalException as stopped:  # a stop (the driver's, scancel's): said in a line, no traceback
        print(f"hpc_rl.bound_torchrun: stopped by {stopped.sigval.name}; the ranks were stopped first",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + int(stopped.sigval)) from None
    finally:
        for pid in end_children():
            print(f"hpc_rl.bound_torchrun: ended pid {pid}, left behind by a trainer rank", file=sys.stderr,
                  flush=True)
    from hpc_rl.engines.child_process import exit_without_teardown

    exit_without_teardown(0)  # every rank is done: skip the agent's teardown (seconds of GC, issue 11)


if __name__ == "__main__":
    main()
