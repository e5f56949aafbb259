"""Benchmark: the colocated hand-over on CPU: trainer offload/onload and one shared-memory weight bucket.

Measures, for a model-sized set of tensors (default 64 MB of fp32 weights, Adam's two moments, a grad
buffer): `TrainerOffload.offload` / `onload` of each tag (GB/s, host -> host here; on a GPU the same calls
copy device -> pinned host), and writing + reading one `/update_weights_from_tensor` shared-memory bucket
(`weights.colocated`) of the weights. Prints numbers; bounded runtime. Usage:
    python benchmarks/bench_colocated_handover.py [--megabytes 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from hpc_rl.training.offload import TrainerOffload
from hpc_rl.weights.colocated import read_shared_memory_bucket, write_shared_memory_bucket


def build(megabytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, megabytes // 16)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(layers)])
    grads = torch.zeros(sum(p.numel() for p in model.parameters()))
    offset = 0
    for p in model.parameters():
        p.main_grad = grads[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()  # materialise the moments
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=64, help="fp32 weights (moments and grads add 3x)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, optimizer = build(args.megabytes)
    offload = TrainerOffload(models=[model], optimizer=optimizer)
    for tag in ("weights", "grads", "optimizer"):
        out, back = [], []
        for _ in range(args.repeat):
            moved = offload.offload([tag])
            out.append(moved["offload/seconds"])
            back.append(offload.onload([tag])["onload/seconds"])
        gb = moved["offload/bytes"] / 1e9
        print(f"{tag:9s} {gb * 1e3:8.1f} MB  offload {min(out) * 1e3:7.1f} ms ({gb / min(out):5.2f} GB/s)  "
              f"onload {min(back) * 1e3:7.1f} ms ({gb / min(back):5.2f} GB/s)")
    named = [(f"layer.{i}.weight", p.detach()) for i, p in enumerate(model.parameters())]
    writes, reads = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        bucket = write_shared_memory_bucket(named)
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        target = [torch.empty_like(t) for _, t in named]
        for (_, view), out in zip(read_shared_memory_bucket(bucket.descriptor), target):
            out.copy_(view)
        reads.append(time.perf_counter() - start)
        bucket.close()
    gb = sum(t.numel() * t.element_size() for _, t in named) / 1e9
    print(f"shm bucket {gb * 1e3:7.1f} MB  write {min(writes) * 1e3:7.1f} ms ({gb / min(writes):5.2f} GB/s)  "
          f"read+copy {min(reads) * 1e3:7.1f} ms ({gb / min(reads):5.2f} GB/s)")


if __name__ == "__main__":
    main()
