"""Small JSON values over torch.distributed collectives, as uint8 tensors — never pickled.

Owns: `broadcast_json` and `all_gather_json`, for the few pieces of metadata trainer ranks exchange
(a step's metrics from the last pipeline stage, the parameter names/shapes each stage holds).
torch's `*_object` collectives pickle, and nothing pickled crosses the network in hpc_rl; these
send the UTF-8 JSON bytes with their length first. Values must be JSON-serialisable (tuples come
back as lists). It sits in `weights/` (below `training/`) because the weight sender gathers
parameter metadata with it; the trainer's step uses it too.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _encode(value: Any, device: torch.device | str) -> torch.Tensor:
    payload = json.dumps(value, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def _decode(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.cpu().numpy()).decode("utf-8"))


def broadcast_json(value: Any, *, src: int, group: dist.ProcessGroup | None,
                   device: torch.device | str = "cpu", is_source: bool | None = None) -> Any:
    """`value` from global rank `src` to every rank of `group`; others pass anything (ignored). `is_source`:
    whether this process is `src` (a group built outside the default world, where `dist.get_rank()` has none)."""
    source = dist.get_rank() == src if is_source is None else is_source
    data = _encode(value, device) if source else None
    length = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if data is None:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return _decode(data)


def all_gather_json(value: Any, *, group: dist.ProcessGroup | None, device: torch.device | str = "cpu") -> list[Any]:
    """Every rank's `value`, in group-rank order."""
    data = _encode(value, device)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [_decode(chunk[: int(n.item())]) for chunk, n in zip(gathered, lengths)]
