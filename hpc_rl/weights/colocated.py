"""Colocated weight update (trainer and engine on the same GPUs): `/update_weights_from_tensor`.

Owns: the request body SGLang 0.5.23 expects: `serialized_named_tensors` holds one string per
engine TP rank, each the base64 of a `ForkingPickler` dump of `[(hf_name, tensor), ...]` (SGLang's
`MultiprocessingSerializer.serialize(..., output_str=True)`). For CUDA tensors the pickle carries
CUDA IPC handles, so the engine maps the trainer's memory without a copy: the tensors must stay
alive (and unchanged) until the engine's HTTP call returns. It cannot run without a GPU; the payload
is unit-tested with CPU tensors (shared-memory handles instead of IPC ones).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One engine TP rank's share: base64(ForkingPickler.dumps(list of (name, tensor)))."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(list(named_tensors))
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The engine side's inverse (for tests and hpc_rl's own engines)."""
    return ForkingPickler.loads(base64.b64decode(payload))


def update_weights_from_tensor_body(
    per_engine_rank: Sequence[Sequence[tuple[str, torch.Tensor]]],
    *,
    weight_version: str | None = None,
    flush_cache: bool = True,
) -> dict[str, Any]:
    """The JSON body of `POST /update_weights_from_tensor`, one serialized list per engine TP rank.

    Every engine TP rank receives the full (unsharded, HF-named) tensors; each rank's list should
    reference tensors on that rank's GPU (the trainer rank colocated with it).
    """
    if not per_engine_rank:
        raise ValueError("update_weights_from_tensor needs at least one engine TP rank's tensors")
    names = [[name for name, _ in rank] for rank in per_engine_rank]
    if any(n != names[0] for n in names):
        raise ValueError("every engine TP rank must receive the same tensor names in the same order")
    body: dict[str, Any] = {
        "serialized_named_tensors": [serialize_named_tensors(rank) for rank in per_engine_rank],
        "load_format": None,
        "flush_cache": flush_cache,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body
