"""The second process of tools/gpu_check.py's colocated check: it rebuilds the trainer's weight shares as an
engine on the same device would, and answers what it read.

Reads one JSON line per share on stdin, `{"share": <serialized_named_tensors entry>}`, and writes one JSON line,
`{"tensors": {name: [shape, dtype, float64 sum, float64 sum of squares]}}` or `{"error": ...}`.

* CUDA IPC handles (what real SGLang 0.5.23 receives): base64 of a ForkingPickler dump whose tensors name the
  sender's GPU by UUID (argument 6 of `rebuild_cuda_tensor`). As SGLang's `monkey_patch_torch_reductions` does
  before `MultiprocessingSerializer.deserialize`, `rebuild_cuda_tensor` is wrapped to map that UUID back to this
  process's device index, then the payload is unpickled; the tensors map the trainer's memory (no copy).
* /dev/shm descriptors (the CPU twin): read with `hpc_rl.weights.colocated.read_shared_memory_bucket`, as
  hpc_rl's CPU engine does.

Only tools/gpu_check.py starts it (it unpickles what its parent sent over a pipe: never anything else).
"""

from __future__ import annotations

import base64
import json
import sys


def _patch_rebuild_cuda_tensor() -> None:
    import torch
    from torch.multiprocessing import reductions

    original = reductions.rebuild_cuda_tensor
    if getattr(original, "_maps_device_uuid", False):
        return

    def rebuild(*args):  # noqa: ANN002, ANN202 - torch's own signature
        device = args[6]
        if isinstance(device, str):  # a UUID: this process's index of that GPU
            indices = [i for i in range(torch.cuda.device_count())
                       if str(torch.cuda.get_device_properties(i).uuid) == device]
            if not indices:
                raise RuntimeError(f"Invalid device_uuid {device}: not a GPU of this process")
            args = (*args[:6], indices[0], *args[7:])
        return original(*args)

    rebuild._maps_device_uuid = True  # type: ignore[attr-defined]
    reductions.rebuild_cuda_tensor = rebuild


def rebuild_share(share: str) -> list[tuple[str, object]]:
    raw = base64.b64decode(share)
    if raw[:1] == b"\x80":  # a pickle: CUDA IPC handles in SGLang's format
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - torch's reductions

        _patch_rebuild_cuda_tensor()
        return ForkingPickler.loads(raw)
    from hpc_rl.weights.colocated import read_shared_memory_bucket

    return read_shared_memory_bucket(share)


def describe(named: list[tuple[str, object]]) -> dict[str, list]:
    import torch

    out = {}
    for name, tensor in named:
        assert isinstance(tensor, torch.Tensor)
        as64 = tensor.detach().to(torch.float64)
        out[name] = [list(tensor.shape), str(tensor.dtype), as64.sum().item(), (as64 * as64).sum().item(),
                     str(tensor.device.type)]
    return out


def main() -> int:
    for line in sys.stdin:
        try:
            answer = {"tensors": describe(rebuild_share(json.loads(line)["share"]))}
        except Exception as error:  # noqa: BLE001 - the parent reports it
            answer = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
