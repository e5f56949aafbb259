"""Trainer side of a colocated weight update: every rank hands its weights to the engine on its own GPUs.

Owns `ColocatedWeightSender`. Colocated engines overlap the trainer's GPUs (engine i, TP size t, on the
GPUs of trainer ranks i*t .. i*t+t-1), so no NCCL group can join them (NCCL refuses two ranks on one
device). Per bucket (the same buckets as the broadcast path, `WeightSender.plan_buckets`):

    every rank:    gather its TP shards into full HF tensors (a TP collective, as the broadcast path;
                   routed experts from their EP rank over the EP group: `export.gather_expert`)
                   serialize them for the engine rank on its GPU (`weights.colocated.serialize_share`:
                   CUDA IPC handles on GPU, a /dev/shm bucket on CPU)
    engine group:  gather the t shares (strings, no pickle between ranks) on its first rank
    first rank:    POST /update_weights_from_tensor (shares in engine TP-rank order) to its engine
    engine group:  agree on the outcome (every rank raises if the engine refused), then free the bucket

The controller opens and closes the engine's weight-update session (begin/end) around the command.
Pipeline parallelism is not supported here (every rank needs every full tensor; PP splits them).
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
from hpc_rl.weights.colocated import serialize_share, update_weights_from_tensor_body
from hpc_rl.weights.export import ExpertLayout, export_param, named_megatron_params
from hpc_rl.weights.hf_mapping import export_dtype
from hpc_rl.weights.sender import WeightSender

log = logging.getLogger(__name__)


def colocated_engine_of(rank: int, engine_tp_size: int) -> tuple[int, int]:
    """(engine index, engine TP rank) of the engine sharing trainer rank `rank`'s GPU."""
    return divmod(rank, engine_tp_size)


def post_update(url: str, body: dict[str, Any], *, api_key: str | None, timeout_s: float) -> None:
    """POST /update_weights_from_tensor; raises RuntimeError with the engine's answer unless it is 200."""
    target = f"{url.rstrip('/')}/update_weights_from_tensor"
    try:  # the engine on this node, reached directly (never through $http_proxy, as urllib would)
        status, answer = request_blocking("POST", target, json.dumps(body).encode(), api_key=api_key,
                                          timeout_s=timeout_s)
    except EngineHTTPTransportError as error:
        raise RuntimeError(f"{target} failed: {error}") from None
    if status != 200:
        raise RuntimeError(f"{target} answered HTTP {status}: {answer[:500].decode(errors='replace')}")


class ColocatedWeightSender:
    """Per-bucket `/update_weights_from_tensor` from the trainer ranks to their colocated engines."""

    def __init__(self, model: torch.nn.Module, arch: ModelArchitecture, *, tp_group: dist.ProcessGroup | None,
                 tp_size: int, rank: int, world_size: int, engine_tp_size: int, bucket_bytes: int,
                 dtype: torch.dtype | None = None, api_key: str | None = None, pp_size: int = 1,
                 experts: ExpertLayout | None = None) -> None:
        if pp_size > 1:
            raise ValueError("colocated weight updates need pipeline_model_parallel_size 1 (every rank sends full "
                             "tensors to the engine on its GPU); use decoupled mode with pipeline parallelism")
        if world_size % engine_tp_size:
            raise ValueError(f"{world_size} trainer ranks do not split into engines of {engine_tp_size} GPUs")
        self.params = named_megatron_params(model)
        self.arch, self.tp_group, self.rank, self.api_key = arch, tp_group, rank, api_key
        self.experts = experts if experts is not None else ExpertLayout.current(arch)
        self.engine_index, self.engine_rank = colocated_engine_of(rank, engine_tp_size)
        self.engine_tp_size = engine_tp_size
        self._planner = WeightSender(model, arch, tp_group=tp_group, tp_size=tp_size, dp_rank=0, rank=rank,
                                     bucket_bytes=bucket_bytes, dtype=dtype)
        self.dtype = self._planner.dtype
        self.engine_group: dist.ProcessGroup | None = None
        if engine_tp_size > 1:  # every rank builds every engine's group, in the same order (a collective)
            for first in range(0, world_size, engine_tp_size):
                group = dist.new_group(list(range(first, first + engine_tp_size)), backend="gloo")
                if first == self.engine_index * engine_tp_size:
                    self.engine_group = group

    def sync(self, *, version: int, engine_url: str, bucket_bytes: int, timeout_s: float = 600.0) -> dict[str, Any]:
        """Send every bucket to this rank's engine as `version` (an empty URL: that engine is down, skip it
        after taking part in the TP gathers the other engines need)."""
        start = time.perf_counter()
        self._planner.set_bucket_bytes(bucket_bytes)
        plan = self._planner.plan_buckets()
        for index, meta in enumerate(plan):
            named: list[tuple[str, torch.Tensor]] = []
            for source in meta.megatron_names:
                named.extend(export_param(source, self.params, self.arch, self.tp_group, self.experts))
            if not engine_url:
                continue
            named = [(name, tensor.to(export_dtype(name, self.dtype)).contiguous()) for name, tensor in named]
            last = index == len(plan) - 1
            self._send_bucket(named, engine_url, weight_version=str(version) if last else None, flush_cache=last,
                              timeout_s=timeout_s)
        return {"buckets": len(plan), "bytes": sum(b.num_bytes for b in plan),
                "seconds": time.perf_counter() - start}

    def _send_bucket(self, named: list[tuple[str, torch.Tensor]], url: str, *, weight_version: str | None,
                     flush_cache: bool, timeout_s: float) -> None:
        share, shared_memory = serialize_share(named)
        try:
            shares = [share] if self.engine_group is None else all_gather_json(share, group=self.engine_group)
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
