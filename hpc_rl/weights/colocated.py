"""Colocated weight update payloads (trainer and engine on the same devices): `/update_weights_from_tensor`.

Owns the two serializations of one engine TP rank's share of a bucket, and the request body:

* GPU (real SGLang 0.5.23): `serialized_named_tensors[i]` is the base64 of a `ForkingPickler` dump of
  `[(hf_name, tensor), ...]` (SGLang's `MultiprocessingSerializer.serialize(..., output_str=True)`,
  read back with its `SafeUnpickler`). CUDA tensors pickle as CUDA IPC handles: the engine maps the
  trainer's memory, no copy. The trainer and the engine see different `CUDA_VISIBLE_DEVICES`, so the
  device index is replaced by the device's UUID (argument 6 of `rebuild_cuda_tensor`), as SGLang's
  `monkey_patch_torch_reductions` does on both sides; SGLang's receiving side patches
  `rebuild_cuda_tensor` before unpickling and maps the UUID back to its own index. The tensors must
  stay alive and unchanged until the engine's HTTP call returned. Same node only; the body crosses
  loopback/the node's address with the engine key, the one pickle hpc_rl lets through (SGLang's own
  format; hpc_rl never unpickles it).
* CPU twin (hpc_rl's CPU engine): no pickle. The trainer packs the bucket into a file in /dev/shm
  (shared memory of the node) and sends a descriptor: base64 of JSON `{"format", "path",
  "total_bytes", "tensors": [{"name", "dtype", "shape", "offset"}], "device"}`. The engine maps the file,
  copies the tensors into its model before answering, and the trainer then removes the file. `device` is
  the sender's GPU (`<node>/gpu<id>`): the engine refuses one it cannot see, as SGLang refuses the UUID of
  a GPU outside its process (`Invalid device_uuid`: a share sent to another node's engine).

Which one is used follows the tensors' device (cuda -> IPC handles, cpu -> shared memory).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler
from torch.multiprocessing import reductions

from hpc_rl.weights.bucket_layout import compute_layout, dtype_name, pack_bucket, unpack_bucket

SHARED_MEMORY_FORMAT = "hpc_rl.cpu_shared_memory.v1"
SHARED_MEMORY_DIR = "/dev/shm"
SHARED_MEMORY_PREFIX = "hpc_rl-weights-"
_REBUILD_ARG_DEVICE = 6
"""Position of the device index in `rebuild_cuda_tensor`'s arguments (torch 2.x; SGLang uses the same)."""


class PayloadError(ValueError):
    """A `serialized_named_tensors` entry the receiving side cannot use; the message says why."""


# ---- GPU: CUDA IPC handles in SGLang's pickle ----------------------------------------------------------
def _reduce_tensor_with_device_uuid(tensor: torch.Tensor) -> tuple[Any, tuple]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:  # GPU only: the receiver's patched rebuild maps the UUID to its own index
        uuid = str(torch.cuda.get_device_properties(args[_REBUILD_ARG_DEVICE]).uuid)
        args = (*args[:_REBUILD_ARG_DEVICE], uuid, *args[_REBUILD_ARG_DEVICE + 1:])
    return rebuild, args


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One engine TP rank's share for SGLang: base64(ForkingPickler dump of a list of (name, tensor))."""
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_with_device_uuid
    pickler.dump([(name, tensor.detach()) for name, tensor in named_tensors])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def serialize_tensor_dict(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """A LoRA adapter for SGLang's /load_lora_adapter_from_tensors: base64(ForkingPickler dump of a dict name ->
    tensor), as its `Engine._serialize_tensors_per_rank` writes it (its tp_worker passes the dict on as is)."""
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_with_device_uuid
    pickler.dump({name: tensor.detach() for name, tensor in named_tensors})
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The inverse for CPU tensors, in one process family (unit tests only: hpc_rl's engines never unpickle)."""
    return ForkingPickler.loads(base64.b64decode(payload))


# ---- CPU twin: shared memory, described in JSON ----------------------------------------------------------
@dataclass
class SharedMemoryBucket:
    """One bucket packed into a /dev/shm file; `close()` removes it (after the engine answered)."""

    path: Path
    descriptor: str

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def write_shared_memory_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]],
                               directory: str = SHARED_MEMORY_DIR, *, device: str | None = None) -> SharedMemoryBucket:
    """Pack the tensors (CPU) into a new 0600 file in shared memory; return it and its descriptor (naming
    the sender's `device` when given)."""
    named = [(n, t.detach().cpu()) for n, t in named_tensors]
    layout = compute_layout([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named])
    handle, name = tempfile.mkstemp(prefix=SHARED_MEMORY_PREFIX, dir=directory)
    path = Path(name)
    try:
        try:
            os.ftruncate(handle, layout.total_bytes)
        finally:
            os.close(handle)
        if layout.total_bytes:  # pack straight into the mapped file: one copy
            mapped = torch.from_file(name, shared=True, size=layout.total_bytes, dtype=torch.uint8)
            pack_bucket(named, out=mapped)
            del mapped
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    described = {"format": SHARED_MEMORY_FORMAT, "path": str(path), "total_bytes": layout.total_bytes,
                 "tensors": [{"name": s.name, "dtype": dtype_name(s.dtype), "shape": list(s.shape), "offset": s.offset}
                             for s in layout.slots]}
    if device:
        described["device"] = device
    return SharedMemoryBucket(path=path, descriptor=base64.b64encode(json.dumps(described).encode()).decode("ascii"))


def read_shared_memory_bucket(payload: str, directory: str = SHARED_MEMORY_DIR, *,
                              check_device: Callable[[str], None] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The engine side: check a descriptor and return views of its tensors (mapped, copy-on-write);
    `check_device` is called with the sender's device first (it raises to refuse the share)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as error:
        raise PayloadError(f"serialized_named_tensors entry is not base64: {error}") from None
    if raw[:1] == b"\x80":
        raise PayloadError("serialized_named_tensors holds a pickle (CUDA IPC handles for SGLang on a GPU): the CPU "
                           f"engine does not unpickle; send a {SHARED_MEMORY_FORMAT} descriptor")
    try:
        described = json.loads(raw)
        if described.get("format") != SHARED_MEMORY_FORMAT:
            raise PayloadError(f"unknown payload format {described.get('format')!r}: expected {SHARED_MEMORY_FORMAT}")
        path = Path(os.path.realpath(described["path"]))
        total = int(described["total_bytes"])
        tensors = described["tensors"]
        layout = compute_layout([t["name"] for t in tensors], [t["dtype"] for t in tensors],
                                [t["shape"] for t in tensors])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        if isinstance(error, PayloadError):
            raise
        raise PayloadError(f"bad {SHARED_MEMORY_FORMAT} descriptor: {error!r}") from None
    if check_device is not None and described.get("device"):
        check_device(str(described["device"]))
    if path.parent != Path(os.path.realpath(directory)) or not path.name.startswith(SHARED_MEMORY_PREFIX):
        raise PayloadError(f"{path} is not an hpc_rl weight bucket in {directory}")
    if [s.offset for s in layout.slots] != [int(t["offset"]) for t in tensors] or layout.total_bytes != total:
        raise PayloadError("descriptor offsets/total_bytes do not match the names, dtypes and shapes it lists")
    if not path.is_file() or path.stat().st_size != total:
        raise PayloadError(f"{path}: missing or not {total} bytes (is the trainer on this node?)")
    if total == 0:
        return unpack_bucket(torch.empty(0, dtype=torch.uint8), layout)
    buffer = torch.from_file(str(path), shared=False, size=total, dtype=torch.uint8)
    return unpack_bucket(buffer, layout)


# ---- the request -----------------------------------------------------------------------------------------
def update_weights_from_tensor_body(
    per_engine_rank: Sequence[str],
    *,
    weight_version: str | None = None,
    flush_cache: bool = True,
) -> dict[str, Any]:
    """The JSON body of `POST /update_weights_from_tensor`: one serialized share per engine TP rank
    (`serialize_named_tensors` or a shared-memory descriptor), in engine TP-rank order."""
    if not per_engine_rank:
        raise ValueError("update_weights_from_tensor needs at least one engine TP rank's share")
    body: dict[str, Any] = {"serialized_named_tensors": list(per_engine_rank), "load_format": None,
                            "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def serialize_share(named_tensors: Sequence[tuple[str, torch.Tensor]], *,
                    device: str | None = None) -> tuple[str, SharedMemoryBucket | None]:
    """This rank's share in the form its engine reads: IPC handles for CUDA tensors (they carry the GPU's
    UUID), else a shared-memory bucket naming the sender's `device` (returned so the caller removes it once
    the engine answered)."""
    if named_tensors and named_tensors[0][1].is_cuda:
        return serialize_named_tensors(named_tensors), None
    bucket = write_shared_memory_bucket(named_tensors, device=device)
    return bucket.descriptor, bucket


def serialize_adapter_share(named_tensors: Sequence[tuple[str, torch.Tensor]], *,
                            device: str | None = None) -> tuple[str, SharedMemoryBucket | None]:
    """A LoRA adapter in the form /load_lora_adapter_from_tensors reads: CUDA tensors as SGLang's pickled dict of
    IPC handles (`serialize_tensor_dict`), CPU ones as a shared-memory bucket (the CPU engine's twin, no pickle)."""
    if named_tensors and named_tensors[0][1].is_cuda:
        return serialize_tensor_dict(named_tensors), None
    return serialize_share(named_tensors, device=device)

