"""A follower node-rank of a multi-node CPU engine (`--node-rank k`, k > 0): health endpoints and weight commands.

Owns what SGLang's node-ranks > 0 do, as the twin (`node_group` explains it): serve `/health`,
`/health_generate` and `/ping` on this node's `--host`/`--port` (SGLang's `launch_dummy_health_check_server`;
nothing else: requests go to node-rank 0), hold a whole model for this node's TP ranks, and apply node-rank 0's
weight and memory commands to it, answering with a digest of what it loaded. Ends when node-rank 0 stops it
(exit 0), when node-rank 0 is gone, or after a share it must refuse (exit 1: SGLang's scheduler dies there,
and the engine with it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from hpc_rl.process.child_process import exit_without_teardown
from hpc_rl.engines.cpu.memory_occupation import MemoryOccupation
from hpc_rl.engines.cpu.node_group import EngineNodes, FollowerFailed, shares_of_node, weights_digest
from hpc_rl.engines.cpu.weight_sync import load_from_disk, load_named, named_tensors, read_tensor_share
from hpc_rl.weights.fp8_blocks import Fp8Intake
from hpc_rl.weights.device_identity import InvisibleDeviceError

log = logging.getLogger(__name__)


def loaded_digest(model: torch.nn.Module, names: list[str]) -> list[float]:
    """The digest of the model's tensors `names`, as the model holds them after a load."""
    tensors = named_tensors(model)
    return weights_digest([(name, tensors[name]) for name in names])


def open_node_shares(shares: list[str], nnodes: int, node_rank: int) -> list[tuple[str, torch.Tensor]]:
    """Open every share of this node's TP ranks (each checked against this node's GPUs, as SGLang's IPC
    handles are); the first one's tensors stand for this node's shards. InvisibleDeviceError is fatal."""
    opened: list[list[tuple[str, torch.Tensor]]] = []
    for share in shares_of_node(shares, nnodes, node_rank):
        try:
            opened.append(read_tensor_share(share))
        except InvisibleDeviceError as error:
            raise FollowerFailed(str(error), fatal=True) from error
    return opened[0] if opened else []


class Follower:
    """Applies node-rank 0's commands to this node's model."""

    def __init__(self, model: torch.nn.Module, nodes: EngineNodes, *, memory_saver: bool) -> None:
        self.model, self.nodes = model, nodes
        self.memory = MemoryOccupation(model, memory_saver=memory_saver)
        self.fp8: Fp8Intake | None = None
        """An FP8 checkpoint's pairing of e4m3 weights and scales (node-rank 0 names the blocks)."""

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command.get("op")
        if op == "update_weights_from_tensor":
            weights = open_node_shares(list(command["shares"]), self.nodes.nnodes, self.nodes.node_rank)
            if command.get("fp8_block"):
                self.fp8 = self.fp8 or Fp8Intake(tuple(command["fp8_block"]))
                weights = self.fp8.take(weights)
            load_named(self.model, weights)
            return {"digest": loaded_digest(self.model, [name for name, _ in weights])}
        if op == "update_weights_from_disk":
            load_from_disk(self.model, str(command["model_path"]))
            return {"digest": loaded_digest(self.model, [name for name, _ in self.model.named_parameters()])}
        if op == "release_memory":
            self.memory.release(list(command["tags"]), requests_running=False)
            return {}
        if op == "resume_memory":
            self.memory.resume(list(command["tags"]))
            return {}
        raise ValueError(f"unknown command {op!r} from node-rank 0")


def serve_follower(model: torch.nn.Module, nodes: EngineNodes, *, host: str, port: int, memory_saver: bool) -> None:
    """Run until node-rank 0 stops this node (or dies); the health endpoints on `host:port` meanwhile."""
    from aiohttp import web

    follower = Follower(model, nodes, memory_saver=memory_saver)

    def commands() -> None:
        code = 0
        try:
            nodes.serve(follower.run)
        except FollowerFailed as error:
            log.critical("node-rank %d: %s: exiting (SGLang's scheduler dies here)", nodes.node_rank, error)
            code = 1
        except RuntimeError as error:
            log.critical("node-rank %d: node-rank 0 is gone (%s): exiting", nodes.node_rank, error)
            code = 1
        logging.shutdown()
        exit_without_teardown(code)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    for path in ("/health", "/health_generate", "/ping"):
        app.router.add_get(path, ok)
    threading.Thread(target=commands, name="node-rank commands", daemon=True).start()
    web.run_app(app, host=host, port=port, print=None, access_log=None, shutdown_timeout=1.0)
    exit_without_teardown(0)
