"""Byte layout of a `flattened_bucket` weight update: pure functions, shared by both sides.

Owns: where each HF-named tensor sits inside the single uint8 tensor that trainer rank 0 broadcasts
when `/update_weights_from_distributed` is called with `load_format="flattened_bucket"`, plus
packing (trainer side) and unpacking (engine side). Does not own the broadcast or the HTTP call.

The layout is SGLang 0.5.23's (`FlattenedTensorBucket`): tensors are concatenated in `names` order,
each as its raw bytes, with NO padding between them; tensor i starts at the sum of the byte sizes of
tensors 0..i-1. A tensor can only be viewed back as its dtype when its byte offset is a multiple of
its dtype size, so `compute_layout` refuses a layout where that is not true. Order a mixed-dtype
bucket by falling dtype size (`order_for_alignment`) to make every offset aligned; a bucket of one
dtype is always aligned.

Trainer side::

    named = order_for_alignment(named_tensors)
    buffer, layout = pack_bucket(named, out=reusable_uint8_buffer)   # reuse buffers (see notes)
    body = {**layout.request_fields(), "load_format": "flattened_bucket", ...}
    # POST body to every engine, then dist.broadcast(buffer, src=0, group=group)

Engine side::

    layout = compute_layout(names, dtypes, shapes)
    buffer = torch.empty(layout.total_bytes, dtype=torch.uint8); dist.broadcast(buffer, 0, group)
    for name, tensor in unpack_bucket(buffer, layout): ...
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype for SGLang's wire name ("bfloat16", "float32", "torch.float16" also accepted)."""
    short = name.removeprefix("torch.")
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(  # noqa: TRY004 - a bad value, not a bad type
            f"unknown dtype name {name!r}: use a torch dtype name such as 'bfloat16'"
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire name of a torch dtype (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in the bucket: bytes [offset, offset + nbytes)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketLayout:
    """The slots of one bucket, in `names` order, and the bucket's size in bytes."""

    slots: tuple[TensorSlot, ...]
    total_bytes: int

    def request_fields(self) -> dict[str, list]:
        """`names`, `dtypes`, `shapes` for the `/update_weights_from_distributed` body."""
        return {
            "names": [slot.name for slot in self.slots],
            "dtypes": [dtype_name(slot.dtype) for slot in self.slots],
            "shapes": [list(slot.shape) for slot in self.slots],
        }


def compute_layout(
    names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]]
) -> BucketLayout:
    """Offsets of each tensor (cumulative, no padding, as SGLang); raises if one is misaligned."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    slots: list[TensorSlot] = []
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        torch_dtype = dtype if isinstance(dtype, torch.dtype) else dtype_from_name(dtype)
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        if offset % itemsize:
            raise ValueError(
                f"tensor {name!r} ({torch_dtype}) would start at byte {offset}, not a multiple of "
                f"{itemsize}: order the bucket by falling dtype size (order_for_alignment) or split it"
            )
        dims = tuple(int(size) for size in shape)
        slot = TensorSlot(name=name, dtype=torch_dtype, shape=dims, offset=offset,
                          nbytes=math.prod(dims) * itemsize)
        slots.append(slot)
        offset += slot.nbytes
    return BucketLayout(slots=tuple(slots), total_bytes=offset)


def order_for_alignment(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same tensors, stably sorted by falling dtype size, so every offset is aligned."""
    return sorted(named_tensors, key=lambda item: -item[1].element_size())


def pack_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
) -> tuple[torch.Tensor, BucketLayout]:
    """Copy the tensors into one uint8 tensor (`out` reused when large enough); return it and the layout."""
    layout = compute_layout(
        [name for name, _ in named_tensors],
        [tensor.dtype for _, tensor in named_tensors],
        [tuple(tensor.shape) for _, tensor in named_tensors],
    )
    if out is None or out.dtype != torch.uint8 or out.numel() < layout.total_bytes:
        device = named_tensors[0][1].device if named_tensors else "cpu"
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    buffer = out[: layout.total_bytes]
    for slot, (_, tensor) in zip(layout.slots, named_tensors):
        region = buffer[slot.offset : slot.offset + slot.nbytes]
        region.view(slot.dtype).view(slot.shape).copy_(tensor)
    return buffer, layout


def unpack_bucket(buffer: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """Views (no copy) of each tensor inside `buffer`, in layout order."""
    if buffer.dtype != torch.uint8 or buffer.numel() < layout.total_bytes:
        raise ValueError(
            f"bucket buffer is {buffer.dtype} with {buffer.numel()} elements; "
            f"expected uint8 with at least {layout.total_bytes}"
        )
    return [
        (slot.name, buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape))
        for slot in layout.slots
    ]
