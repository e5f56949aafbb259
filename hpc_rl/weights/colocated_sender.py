"""Trainer side of a colocated weight update: every rank hands its weights to the engine on its own GPU.

Owns `ColocatedWeightSender`. Colocated engines overlap the trainer's GPUs, so no NCCL group can join them
(NCCL refuses two ranks on one device). Which engine (and engine TP rank) shares a rank's GPU comes from
the controller with every command (`rank_engines`: paired by node and GPU identity, never by rank
numbers: torchrun orders nodes by name, Slurm by its own list). Per bucket (the same buckets as the
broadcast path, `WeightSender.plan_buckets`):

    every rank:    gather its TP shards into full HF tensors (a TP collective, as the broadcast path;
                   routed experts from their EP rank over the EP group: `export.gather_expert`), the family's
                   fusion groups fused (gpt-oss's experts per layer: `engine_fusion`)
                   serialize them for the engine rank on its GPU (`weights.colocated.serialize_share`:
                   CUDA IPC handles on GPU, a /dev/shm bucket on CPU naming the sender's GPU)
    engine group:  gather the t shares (strings, no pickle between ranks) on the engine's TP rank 0's rank
    that rank:     POST /update_weights_from_tensor (shares in engine TP-rank order) to its engine
    engine group:  agree on the outcome (every rank raises if the engine refused), then free the bucket
    after the last bucket (GPU): release the IPC handles the engines closed and the cached blocks

The controller opens and closes the engine's weight-update session (begin/end) around the command.

Pipeline parallelism: each rank holds only its stage's layers, yet every engine GPU needs all of them. As in
slime's colocated path, each parameter goes from the stage that holds it to every stage over the pipeline groups
(`WeightSender.export_everywhere`: TP shards, then each stage's TP gather), so every rank has the bucket's full
tensors before it serializes its share: the buckets (planned over the whole model, the same on every rank) cost
one broadcast per parameter per pipeline group, and no rank holds more than one bucket. A multi-node engine
changes nothing here: its TP ranks on every node are paired with the trainer ranks on their GPUs, and the
engine group (gloo, over the trainer's world) gathers their shares on node-rank 0's GPU 0 rank, which posts them.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.protocol.http_client import EngineHTTPTransportError, request_blocking
from hpc_rl.weights.json_collectives import all_gather_json
from hpc_rl.weights.bucket_layout import order_for_alignment
from hpc_rl.weights.colocated import serialize_share, update_weights_from_tensor_body
from hpc_rl.weights.export import named_megatron_params
from hpc_rl.config.fp8_scheme import Fp8Blocks
from hpc_rl.weights.sender import WeightSender, wire_tensors

log = logging.getLogger(__name__)


def post_to_local_engine(url: str, endpoint: str, body: dict[str, Any], *, api_key: str | None,
                         timeout_s: float) -> None:
    """POST `body` to the engine on this node's `endpoint`; RuntimeError with the engine's answer unless it is 200."""
    target = f"{url.rstrip('/')}/{endpoint}"
    try:  # the engine on this node, reached directly (never through $http_proxy, as urllib would)
        status, answer = request_blocking("POST", target, json.dumps(body).encode(), api_key=api_key,
                                          timeout_s=timeout_s)
    except EngineHTTPTransportError as error:
        raise RuntimeError(f"{target} failed: {error}") from None
    if status != 200:
        raise RuntimeError(f"{target} answered HTTP {status}: {answer[:500].decode(errors='replace')}")


def post_update(url: str, body: dict[str, Any], *, api_key: str | None, timeout_s: float) -> None:
    """POST /update_weights_from_tensor (`post_to_local_engine`)."""
    post_to_local_engine(url, "update_weights_from_tensor", body, api_key=api_key, timeout_s=timeout_s)


class ColocatedWeightSender:
    """Per-bucket `/update_weights_from_tensor` from the trainer ranks to their colocated engines."""

    def __init__(self, model: torch.nn.Module, arch: ModelArchitecture, *, tp_group: dist.ProcessGroup | None,
                 tp_size: int, rank: int, world_size: int, bucket_bytes: int, dtype: torch.dtype | None = None,
                 api_key: str | None = None, pp_group: dist.ProcessGroup | None = None, pp_rank: int = 0,
                 pp_size: int = 1, device: str | None = None, fp8: Fp8Blocks | None = None) -> None:
        self.params = named_megatron_params(model)
        self.arch, self.tp_group, self.rank, self.world_size, self.api_key = arch, tp_group, rank, world_size, api_key
        self.device = device
        """This rank's device identity, written into CPU shares (the CPU engine checks it, as SGLang the UUID)."""
        self._planner = WeightSender(model, arch, tp_group=tp_group, tp_size=tp_size, dp_rank=0, rank=rank,
                                     bucket_bytes=bucket_bytes, dtype=dtype, pp_group=pp_group, pp_rank=pp_rank,
                                     pp_size=pp_size, fp8=fp8)
        self.dtype = self._planner.dtype
        self.rank_engines: list[tuple[int, int]] = []
        self.engine_index, self.engine_rank = -1, -1
        self.engine_group: dist.ProcessGroup | None = None

    def pair(self, rank_engines: list[list[int]]) -> None:
        """Take the controller's pairing; when it changed, every rank builds every engine's group of ranks
        (a collective: every rank gets the same command), ordered by engine TP rank."""
        pairs = [(int(engine), int(tp_rank)) for engine, tp_rank in rank_engines]
        if len(pairs) != self.world_size:
            raise ValueError(f"the controller paired {len(pairs)} trainer ranks with engines; there are {self.world_size}")
        if pairs == self.rank_engines:
            return
        self.rank_engines = pairs
        self.engine_index, self.engine_rank = pairs[self.rank]
        self.engine_group = None
        members: dict[int, list[tuple[int, int]]] = {}
        for rank, (engine, tp_rank) in enumerate(pairs):
            members.setdefault(engine, []).append((tp_rank, rank))
        for engine in sorted(members):
            ranks = [rank for _, rank in sorted(members[engine])]
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks, backend="gloo")  # every rank calls it, in the same order
            if engine == self.engine_index:
                self.engine_group = group

    def sync(self, *, version: int, engine_url: str, bucket_bytes: int, rank_engines: list[list[int]],
             timeout_s: float = 600.0) -> dict[str, Any]:
        """Send every bucket to this rank's engine as `version` (an empty URL: that engine is down, skip it
        after taking part in the TP gathers the other engines need)."""
        start = time.perf_counter()
        self.pair(rank_engines)
        self._planner.set_bucket_bytes(bucket_bytes)
        plan = self._planner.plan_buckets()
        for index, meta in enumerate(plan):
            # every rank: the full tensors (TP gather; under PP, from each stage), the family's groups fused
            named = self._planner.export_bucket_everywhere(index)
            if not engine_url:
                continue
            named = order_for_alignment([(name, tensor.contiguous())  # FP8: e4m3 beside float32 scales
                                         for name, tensor in wire_tensors(named, self.dtype, self._planner.fp8)])
            last = index == len(plan) - 1
            self._send_bucket(named, engine_url, weight_version=str(version) if last else None, flush_cache=last,
                              timeout_s=timeout_s)
        if torch.cuda.is_available():  # GPU only: the last IPC handles the engines closed, and cached blocks
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        return {"buckets": len(plan), "bytes": sum(b.num_bytes for b in plan),
                "seconds": time.perf_counter() - start}

    def _send_bucket(self, named: list[tuple[str, torch.Tensor]], url: str, *, weight_version: str | None,
                     flush_cache: bool, timeout_s: float) -> None:
        share, shared_memory = serialize_share(named, device=self.device)
        try:
            gathered = ([[self.engine_rank, share]] if self.engine_group is None
                        else all_gather_json([self.engine_rank, share], group=self.engine_group))
            shares = [item[1] for item in sorted(gathered)]  # engine TP-rank order
            error = ""
            if self.engine_rank == 0:
                try:
                    post_update(url, update_weights_from_tensor_body(shares, weight_version=weight_version,
                                                                     flush_cache=flush_cache),
                                api_key=self.api_key, timeout_s=timeout_s)
                except RuntimeError as failure:
                    error = str(failure)
            # The other ranks keep their tensors alive until the engine answered, and learn its answer.
            errors = [error] if self.engine_group is None else all_gather_json(error, group=self.engine_group)
            if any(errors):
                raise RuntimeError(f"engine {self.engine_index}: {next(e for e in errors if e)}")
        finally:
            if shared_memory is not None:
                shared_memory.close()
            del named
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # GPU only: release IPC handles the engine has closed
