"""Numeric arrays on the wire: raw bytes plus a (dtype, shape, offset, nbytes) descriptor; never Python objects.

Owns the dtype whitelist, the payload layout (each array 64-byte aligned, little-endian, C order) and
decoding back into arrays that share the received buffer (zero-copy, writable). numpy arrays come back as
numpy arrays, CPU torch tensors as torch tensors (torch is imported only when a tensor is involved);
bfloat16, which numpy lacks, travels as its raw 16-bit pattern and comes back as a torch tensor.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from hpc_rl.protocol.errors import MalformedFrameError, ProtocolError

ALIGNMENT = 64
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "float64": "<f8",
        "float32": "<f4",
        "float16": "<f2",
        "bfloat16": "<u2",  # raw bit pattern; decoded through torch
        "int64": "<i8",
        "int32": "<i4",
        "int16": "<i2",
        "int8": "i1",
        "uint8": "u1",
        "bool": "?",
    }.items()
}
"""The only dtypes allowed on the wire, by wire name."""


def is_array(value: Any) -> bool:
    """True for a numpy array or a torch tensor (without importing torch)."""
    if isinstance(value, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _to_numpy(value: Any) -> tuple[np.ndarray, str, bool]:
    """(C-contiguous little-endian numpy view or copy, wire dtype name, came from torch)."""
    if isinstance(value, np.ndarray):
        name = value.dtype.name
        if name not in WIRE_DTYPES or value.dtype.kind == "O":
            raise ProtocolError(
                f"cannot send an array of dtype {value.dtype}; allowed: {', '.join(WIRE_DTYPES)}"
            )
        arr = np.asarray(value, dtype=WIRE_DTYPES[name], order="C")  # keeps 0-d arrays 0-d
        return arr, name, False
    import torch

    if value.device.type != "cpu":
        raise ProtocolError(
            f"cannot send a tensor on {value.device}: move it to the CPU first (tensor.cpu())"
        )
    tensor = value.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16), "bfloat16", True
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise ProtocolError(
            f"cannot send a tensor of dtype {tensor.dtype}; allowed: {', '.join(WIRE_DTYPES)}"
        )
    return np.asarray(tensor.numpy(), dtype=WIRE_DTYPES[name], order="C"), name, True


def encode_arrays(arrays: list[Any]) -> tuple[list[dict[str, Any]], list[memoryview]]:
    """Describe and lay out arrays: (descriptors for the JSON header, payload buffers to send in order)."""
    descriptors: list[dict[str, Any]] = []
    parts: list[memoryview] = []
    offset = 0
    for value in arrays:
        arr, name, from_torch = _to_numpy(value)
        pad = -offset % ALIGNMENT
        if pad:
            parts.append(memoryview(bytes(pad)))
            offset += pad
        descriptor: dict[str, Any] = {
            "dtype": name,
            "shape": list(arr.shape),
            "offset": offset,
            "nbytes": arr.nbytes,
        }
        if from_torch:
            descriptor["torch"] = True
        descriptors.append(descriptor)
        if arr.nbytes:
            parts.append(arr.reshape(-1).view(np.uint8).data)
            offset += arr.nbytes
    return descriptors, parts


def _check_descriptor(index: int, d: Any, payload_len: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
    if not isinstance(d, dict):
        raise MalformedFrameError(f"array descriptor {index} is not an object: {d!r}")
    name, shape, offset, nbytes = d.get("dtype"), d.get("shape"), d.get("offset"), d.get("nbytes")
    if name not in WIRE_DTYPES:
        raise MalformedFrameError(f"array {index}: dtype {name!r} is not one of {', '.join(WIRE_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise MalformedFrameError(f"array {index}: bad shape {shape!r}")
    if not isinstance(offset, int) or not isinstance(nbytes, int) or offset < 0 or nbytes < 0:
        raise MalformedFrameError(f"array {index}: bad offset/nbytes {offset!r}/{nbytes!r}")
    dtype = WIRE_DTYPES[name]
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise MalformedFrameError(f"array {index}: {nbytes} bytes do not hold shape {shape} of {name}")
    if offset + nbytes > payload_len:
        raise MalformedFrameError(
            f"array {index}: bytes {offset}..{offset + nbytes} beyond the payload ({payload_len})"
        )
    return dtype, tuple(shape), offset, nbytes


def decode_arrays(descriptors: Any, payload: memoryview) -> list[Any]:
    """Arrays from their descriptors, as views into ``payload`` (no copy; writable if the payload is)."""
    if not isinstance(descriptors, list):
        raise MalformedFrameError(f"'arrays' in the header must be a list, got {type(descriptors).__name__}")
    out: list[Any] = []
    for i, d in enumerate(descriptors):
        dtype, shape, offset, nbytes = _check_descriptor(i, d, payload.nbytes)
        if nbytes:
            arr = np.frombuffer(payload, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).reshape(
                shape
            )
        else:
            arr = np.empty(shape, dtype=dtype)
        if d["dtype"] == "bfloat16":
            import torch

            out.append(torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16))
        elif d.get("torch"):
            import torch

            out.append(torch.from_numpy(arr))
        else:
            out.append(arr)
    return out
