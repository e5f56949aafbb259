"""The address trainer rank 0 advertises to the engines for the weight-update group.

Owns: picking this node's address from the list the driver hands the trainer step
(`TRAINER_NODE_ADDRESSES_ENV`: every trainer node's address, resolved by the driver the way it
resolves every server it places) and the `SYNC_ADDRESS_ENV` override (tests, hand-started
trainers). The listed address this host can bind is its own: torchrun's c10d rendezvous gives
rank 0 to the node whose descriptor sorts first, not to the first node, so the index alone would
not do. Never `gethostbyname(gethostname())`: Debian-style hosts map their own name to 127.0.1.1
in /etc/hosts, which no engine on another node can reach.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping

SYNC_ADDRESS_ENV = "HPC_RL_WEIGHT_SYNC_ADDRESS"
"""Explicit address engines use to reach trainer rank 0 (overrides the driver's list)."""
TRAINER_NODE_ADDRESSES_ENV = "HPC_RL_TRAINER_NODE_ADDRESSES"
"""Comma-separated addresses of the trainer step's nodes, written by the driver."""


def binds_here(address: str) -> bool:
    """True when a socket on this host can bind `address` (it belongs to one of its interfaces)."""
    try:
        infos = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    family, _, _, _, sockaddr = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(sockaddr)
    except OSError:
        return False
    return True


def weight_sync_address(environ: Mapping[str, str], *, is_local: Callable[[str], bool] = binds_here) -> str:
    """This node's address for the weight-update group's TCP store (trainer rank 0 hosts it)."""
    explicit = environ.get(SYNC_ADDRESS_ENV, "").strip()
    if explicit:
        return explicit
    listed = [a.strip() for a in environ.get(TRAINER_NODE_ADDRESSES_ENV, "").split(",") if a.strip()]
    if not listed:
        raise RuntimeError(f"no weight-sync address: the driver passes the trainer nodes' addresses in "
                           f"${TRAINER_NODE_ADDRESSES_ENV}; a trainer started by hand needs "
                           f"${SYNC_ADDRESS_ENV}=<the address engines reach this node at>")
    mine = [a for a in listed if is_local(a)]
    if not mine:
        raise RuntimeError(f"none of the trainer node addresses in ${TRAINER_NODE_ADDRESSES_ENV} "
                           f"({', '.join(listed)}) belongs to this host ({socket.gethostname()}): "
                           f"set ${SYNC_ADDRESS_ENV} to the address engines reach it at")
    return mine[0]
