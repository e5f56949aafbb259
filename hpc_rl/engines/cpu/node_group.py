"""The CPU engine as a multi-node engine: node-rank 0 serves the API, the others hold their TP ranks' weights.

Owns the twin of SGLang's multi-node serving (`--nnodes N --node-rank k --dist-init-addr HOST:PORT`). In SGLang
every node-rank joins one torch.distributed world at the dist-init address before loading; node-rank 0 runs the
HTTP server and tokenizer and hands every request to the schedulers of all TP ranks, on every node; the other
node-ranks serve only `/health`, `/health_generate` and `/ping` on their own host and port. A colocated weight
update reaches node-rank 0 as one list of shares, one per TP rank, and each TP rank opens its own entry: CUDA IPC
handles that only a process on the sender's GPU can open (`Invalid device_uuid` kills that scheduler, and with it
the engine).

The twin: the node-ranks join a gloo group at the dist-init address (`EngineNodes`); node-rank 0 generates on a
whole model (the CPU engine's TP is not real) and forwards each weight command to the followers as JSON
(`forward`). Each follower holds a whole model too, standing for its TP ranks' shards: it opens the shares of its
TP ranks (k*T .. k*T+T-1, T = TP size / N) with the device check of SGLang's IPC path, loads them, and answers
with a digest of what it loaded; node-rank 0 compares the digests with its own. So a share that reached the
wrong node kills the engine (as on GPUs), and a follower that was handed other weights than node-rank 0 (a
pipeline stage that sent a stale or partial model) fails the update, where SGLang would serve an incoherent
model. Memory release/resume is forwarded too (released weights are discarded on every node).

What it does not follow: a weight-update group (decoupled mode's broadcast), which SGLang's TP ranks on every node
join with their own ranks; the CPU engine joins one rank, so a multi-node CPU engine refuses
`/init_weights_update_group` (and submit refuses the config; colocated and disk transports work).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.weights.json_collectives import all_gather_json, broadcast_json
from hpc_rl.weights.process_group import destroy_weight_update_group, init_weight_update_group

log = logging.getLogger(__name__)

NODE_GROUP_NAME = "hpc_rl_engine_nodes"


class FollowerFailed(RuntimeError):
    """A follower node-rank could not apply a command; `fatal`: SGLang's engine would die of it."""

    def __init__(self, message: str, *, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


def parse_dist_init_addr(address: str) -> tuple[str, int]:
    """`HOST:PORT` (SGLang's `--dist-init-addr`)."""
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def weights_digest(weights: list[tuple[str, torch.Tensor]]) -> list[float]:
    """A digest of named tensors as a node holds them: per tensor, the float64 sum of its values and of their
    squares (NaN for discarded weights: a NaN never equals itself, so it never matches)."""
    digest = []
    for _, tensor in weights:
        values = tensor.detach().to(torch.float64)
        digest += [float(values.sum()), float((values * values).sum())]
    return digest


def same_digest(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=0.0, abs_tol=0.0) for x, y in zip(a, b))


class EngineNodes:
    """One engine's node-ranks in a gloo group (node-rank 0 leads). Commands are JSON, never pickled."""

    def __init__(self, *, nnodes: int, node_rank: int, dist_init_addr: str, device_id: str | None,
                 timeout_s: float = 600.0) -> None:
        if nnodes < 2 or not 0 <= node_rank < nnodes:
            raise ValueError(f"node-rank {node_rank} of {nnodes} nodes: a multi-node engine needs --nnodes >= 2 "
                             "and 0 <= --node-rank < --nnodes")
        host, port = parse_dist_init_addr(dist_init_addr)
        self.nnodes, self.node_rank = nnodes, node_rank
        # node-rank 0 hosts the rendezvous on its own address (as SGLang's dist-init); blocks until all joined
        self.group: dist.ProcessGroup | None = init_weight_update_group(
            master_address=host, master_port=port, rank=node_rank, world_size=nnodes, group_name=NODE_GROUP_NAME,
            backend="gloo", timeout_seconds=timeout_s, device_id=device_id)
        self._lock = threading.Lock()

    def _broadcast(self, value: Any) -> Any:
        return broadcast_json(value, src=0, group=self.group, is_source=self.node_rank == 0)

    # -- node-rank 0 ---------------------------------------------------------------------------------------
    def forward(self, command: dict[str, Any], own: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Node-rank 0: run `command` on every follower; their answers (node-rank order, 1..N-1). A follower
        that failed raises FollowerFailed; a follower gone (its process died) raises RuntimeError."""
        with self._lock:
            self._broadcast(command)
            answers = all_gather_json(own or {}, group=self.group)[1:]
        for rank, answer in enumerate(answers, start=1):
            if answer.get("error"):
                raise FollowerFailed(f"node-rank {rank}: {answer['error']}", fatal=bool(answer.get("fatal")))
        return answers

    def stop_followers(self) -> None:
        """Node-rank 0 stops: the followers stop too (SGLang's ShutdownReq to every rank)."""
        if self.group is None:
            return
        try:
            with self._lock:
                self._broadcast({"op": "stop"})
        except RuntimeError as error:  # a follower already gone
            log.warning("stopping the follower node-ranks: %s", error)
        self.close()

    def close(self) -> None:
        if self.group is not None:
            destroy_weight_update_group(self.group)
            self.group = None

    # -- followers -----------------------------------------------------------------------------------------
    def serve(self, run: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """A follower: apply node-rank 0's commands until it says stop. A command whose answer is fatal ends
        the follower after answering (SGLang's scheduler dies there). RuntimeError when node-rank 0 is gone."""
        while True:
            command = self._broadcast(None)
            if command.get("op") == "stop":
                return
            try:
                answer = run(command)
            except FollowerFailed as error:
                answer = {"error": str(error), "fatal": error.fatal}
            except (KeyError, ValueError, RuntimeError, OSError) as error:
                answer = {"error": f"{type(error).__name__}: {error}", "fatal": False}
            all_gather_json(answer, group=self.group)
            if answer.get("fatal"):
                raise FollowerFailed(answer["error"], fatal=True)


def shares_of_node(shares: list[str], nnodes: int, node_rank: int) -> list[str]:
    """The entries of `serialized_named_tensors` a node-rank's TP ranks open (TP ranks are split evenly over
    the nodes, in order: SGLang's tp_rank_range)."""
    if len(shares) % nnodes:
        raise ValueError(f"{len(shares)} serialized_named_tensors entries do not split over {nnodes} nodes (one "
                         "per TP rank of the engine, the same number on every node)")
    per_node = len(shares) // nnodes
    return shares[node_rank * per_node:(node_rank + 1) * per_node]
