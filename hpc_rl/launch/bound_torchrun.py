"""`python -m hpc_rl.launch.bound_torchrun [--fork-preloaded-ranks] ARGS`: torchrun (same ARGS) whose stores
listen on one address, and whose ranks can start with their imports done.

Owns narrowing torchrun's two TCPStore servers, the c10d rendezvous store (at `--rdzv-endpoint`) and the
store it shares with its worker ranks, to the address in `STORE_ADDRESS_ENV` (the driver sets 127.0.0.1
for a local run). torch gives neither a bind address: they would listen on every interface without
authentication (see `hpc_rl.weights.bound_store`). Without the variable this is plain torchrun (a
multi-node trainer needs its stores reachable from the other nodes; see the README's "What listens").

Also owns naming each node to torchrun: in a Slurm step without `--local-addr`, the node's Slurm name
(`SLURMD_NODENAME`, when it resolves) is passed as `--local-addr`. torchrun numbers nodes by sorting
these names (c10d rendezvous), and publishes rank 0's as the workers' MASTER_ADDR; the default,
`socket.getfqdn()`, is the same on the virtual nodes of one machine (ranks then follow process ids) and
"localhost" on some misconfigured nodes. Nothing in hpc_rl relies on the order (colocated ranks find
their engine by device identity), but with names the local test cluster orders nodes as a real one does.
Also owns that no process of a rank outlives the agent: it is a child subreaper, and ends what a dead
rank left behind (`hpc_rl.launch.orphans`) before it exits.

And owns `--fork-preloaded-ranks` (CPU trainers; the driver passes it when `cluster.device` is cpu): for
`-m MODULE` (anything else: plain torchrun), this process imports what MODULE's ranks would
(`MODULE.__main__.preload()`: torch and Megatron-core, seconds of CPU) and then forks the ranks
(torchrun's `--start-method fork` with a function entrypoint), which call `MODULE.__main__.main(ARGS)`.
Each rank starts with its imports done instead of importing torch again after this launcher did: on 2
cores, 1-2 CPU-seconds less on the trainer's start-up path (issue 23). A forked rank has this launcher's
command line and environment (RANK & co. are set in-process): find ranks by what they register, not by
`ps`. Not on GPUs: a process that has asked CUDA anything cannot fork ranks that use it.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from hpc_rl.launch.orphans import become_subreaper, end_children

STORE_ADDRESS_ENV = "HPC_RL_STORE_ADDRESS"
FORK_FLAG = "--fork-preloaded-ranks"


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


def forked_rank(module: str, *args: str) -> None:
    """A rank forked from this launcher: the signal handling of a fresh process (torchrun's agent catches
    SIGTERM and SIGINT to stop its ranks; a rank must die of them as a spawned one does), then
    `MODULE.__main__.main(args)`. Returning (not `sys.exit`) lets torchrun collect the rank's result; the
    forked process then ends with `os._exit`, without the interpreter's teardown."""
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # as the `python -u` of a spawned rank, near enough
    sys.argv = [module, *args]
    importlib.import_module(f"{module}.__main__").main(list(args))


def _fork_preloaded_ranks() -> None:
    """torchrun's `-m MODULE ARGS` becomes: preload MODULE's imports here, fork each rank into `forked_rank`."""
    import torch.distributed.run as torchrun

    original: Callable[..., Any] = torchrun.config_from_args

    def config_from_args(args: Any) -> tuple[Any, Any, list[str]]:
        config, command, command_args = original(args)
        if not args.module or args.no_python:  # a script or a program: nothing to preload, plain torchrun
            return config, command, command_args
        entry = importlib.import_module(f"{args.training_script}.__main__")
        getattr(entry, "preload", lambda: None)()
        config.start_method = "fork"
        return config, forked_rank, [args.training_script, *args.training_script_args]

    torchrun.config_from_args = config_from_args


def with_node_name(argv: list[str], environ: Mapping[str, str], *,
                   resolves: Callable[[str], bool] | None = None) -> list[str]:
    """`argv` with `--local-addr=<SLURMD_NODENAME>` first, in a Slurm step whose node name resolves and
    whose argv names no local address itself."""
    name = environ.get("SLURMD_NODENAME", "")
    if not name or any(arg == "--local-addr" or arg.startswith("--local-addr=") for arg in argv):
        return argv
    if not (resolves or _resolves)(name):
        return argv
    return [f"--local-addr={name}", *argv]


def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return False
    return True


def main() -> None:
    address = os.environ.get(STORE_ADDRESS_ENV)
    if address:
        _bind_store_servers(address)
    sys.argv[1:] = with_node_name(sys.argv[1:], os.environ)
    if FORK_FLAG in sys.argv:
        sys.argv.remove(FORK_FLAG)
        _fork_preloaded_ranks()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

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
    from hpc_rl.process.child_process import exit_without_teardown

    exit_without_teardown(0)  # every rank is done: skip the agent's teardown (seconds of GC, issue 11)


if __name__ == "__main__":
    main()
