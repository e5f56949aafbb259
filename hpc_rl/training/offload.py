"""Trainer memory offload for colocated mode: hand the device memory to the engines during generation.

Owns: `TrainerOffload`, which moves a trainer rank's state off its device and back, by tag:

    weights    actor parameters (and the reference model's): copied to host memory, then freed
    grads      DDP gradient buffers (`param.main_grad`): freed without a copy, zeroed on onload
               (every optimizer step starts from zeroed grad buffers, so nothing is lost)
    optimizer  optimizer state (Adam moments, fp32 main params on GPU): copied to host, then freed

It works on storages, not tensors: every view (Megatron's params and grads are views into contiguous
buffers) keeps pointing at the same storage, which is resized to 0 bytes on offload and back to its size
on onload, then refilled. This is the trick torch FSDP uses to free parameter memory; slime gets the same
effect from torch_memory_saver (unmapping the physical pages, keeping the addresses). On CUDA, freed
blocks go back to the driver (`torch.cuda.empty_cache`) so SGLang can map them, and host copies are
pinned. On CPU the same calls run (host -> host copies): the order is what the twin tests, and
`require_onloaded` turns a use of offloaded state into a clear error (on a GPU it would read freed memory).

With `training.offload_train: false` (slime's `--no-offload-train`) the same commands keep everything on the
device: an offload only hands the allocator's cached, unused blocks back to the driver (slime's clear_memory),
so the engines' KV cache must fit beside the whole trainer (size `--sglang-mem-fraction-static` for that).

Before an onload puts state back, it checks that the device has room for it plus
`training.train_memory_margin_bytes` (vime's --train-memory-margin-bytes: headroom for the trainer's
transient allocations beside the engines' memory) and raises `NotEnoughDeviceMemory`, naming the numbers
and the knobs, instead of failing with an out-of-memory error part-way through the onload. On CPU there is
no device memory to ask (`device_free_bytes` is None) and the check is skipped.

Colocated order (the controller drives it, `hpc_rl.controller.colocated_memory`):
    generation: offloaded ──> onload all ──> train ──> [save] ──> offload grads, optimizer
    ──> weight update to the engines (reads the weights) ──> offload weights ──> engines resume KV cache
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

OFFLOAD_TAGS = ("weights", "grads", "optimizer")
log = logging.getLogger(__name__)


class OffloadedStateError(RuntimeError):
    """Trainer state used while it is offloaded (a colocated ordering bug)."""


class NotEnoughDeviceMemory(RuntimeError):
    """An onload would leave less than the margin free on the device."""


def cuda_free_bytes() -> int | None:
    """Free bytes of the current CUDA device, or None without one (CPU runs: nothing to check)."""
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()  # GPU only
    return int(free)


def onload_problem(*, free_bytes: int | None, needed_bytes: int, margin_bytes: int) -> str | None:
    """Why an onload of `needed_bytes` must not start (None: it fits with `margin_bytes` to spare)."""
    if free_bytes is None or needed_bytes == 0 or free_bytes >= needed_bytes + margin_bytes:
        return None
    gib = 1024**3
    return (f"onloading the trainer needs {needed_bytes / gib:.2f} GiB plus the {margin_bytes / gib:.2f} GiB margin "
            f"(training.train_memory_margin_bytes), but the device has {free_bytes / gib:.2f} GiB free beside the "
            f"engines: lower --sglang-mem-fraction-static (or --train-memory-margin-bytes)")


@dataclass
class _Offloaded:
    storage: torch.UntypedStorage
    nbytes: int
    host_copy: torch.Tensor | None
    """None: the content is dropped (grads) and zeroed on onload."""


def _optimizers(optimizer: object) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside hpc_rl's optimizer wrappers and Megatron's (chained ones included)."""
    found: list[torch.optim.Optimizer] = []
    stack, seen = list(optimizer) if isinstance(optimizer, list) else [optimizer], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, torch.optim.Optimizer):
            found.append(current)
            continue
        chained = getattr(current, "chained_optimizers", None)
        if isinstance(chained, list):  # Megatron's ChainedOptimizer (dense + expert at EP > 1): its `.optimizer`
            stack.extend(chained)      # property asserts when it chains more than one
            continue
        for attribute in ("torch_optimizer", "optimizer"):
            stack.append(getattr(current, attribute, None))
    return found


def optimizer_tensors(optimizer: object) -> list[torch.Tensor]:
    """Optimizer state tensors and the params the torch optimizer owns (fp32 main params on GPU)."""
    tensors: list[torch.Tensor] = []
    for torch_optimizer in _optimizers(optimizer):
        for state in torch_optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for group in torch_optimizer.param_groups:
            tensors.extend(group["params"])
    return tensors


class TrainerOffload:
    """Offload/onload of one trainer rank's model, reference model, grads and optimizer state."""

    def __init__(self, *, models: Iterable[torch.nn.Module], optimizer: object, enabled: bool = True,
                 margin_bytes: int = 0, device_free_bytes: Callable[[], int | None] = cuda_free_bytes,
                 host_buffers: dict[str, list[torch.Tensor]] | None = None) -> None:
        self.models = [m for m in models if m is not None]
        self.optimizer = optimizer
        self.enabled = enabled
        self.margin_bytes = margin_bytes
        """Bytes that must stay free on the device after an onload (training.train_memory_margin_bytes)."""
        self.device_free_bytes = device_free_bytes
        """False: offload/onload move nothing (the state stays on the device; see the module docstring)."""
        self._told_kept = False
        self._offloaded: dict[str, list[_Offloaded]] = {}
        self._host_buffers: dict[str, list[torch.Tensor]] = host_buffers if host_buffers is not None else {}
        """Host copies kept across cycles (pinned memory is slow to allocate), by tag, in storage order; shared
        with other offloads of the same leading models whose moves never overlap this one's (the actor's weights
        make room for a frozen model in training, and leave for the engines in generation: one host copy)."""

    # ---- what belongs to which tag -------------------------------------------------------------------
    def _tensors(self, tag: str) -> list[torch.Tensor]:
        params = [p for model in self.models for p in model.parameters()]
        if tag == "weights":
            return params
        if tag == "grads":
            return [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
        if tag == "optimizer":
            weights = {p.untyped_storage().data_ptr() for p in params}
            return [t for t in optimizer_tensors(self.optimizer) if t.untyped_storage().data_ptr() not in weights]
        raise ValueError(f"unknown offload tag {tag!r}: use {list(OFFLOAD_TAGS)}")

    @property
    def offloaded_tags(self) -> list[str]:
        return sorted(self._offloaded)

    def require_onloaded(self, what: str) -> None:
        if self._offloaded:
            raise OffloadedStateError(f"{what} while trainer state {self.offloaded_tags} is offloaded: the "
                                      "controller must onload it first (colocated order)")

    # ---- the two moves -------------------------------------------------------------------------------
    @torch.no_grad()
    def offload(self, tags: Iterable[str]) -> dict[str, float]:
        start, moved = time.perf_counter(), 0
        if not self.enabled:
            for tag in tags:
                self._tensors(tag)  # an unknown tag is still an error
            if not self._told_kept:
                log.info("training.offload_train is false: the trainer keeps its weights, grads and optimizer "
                         "state on the device while the engines generate")
                self._told_kept = True
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return {"offload/bytes": 0.0, "offload/seconds": time.perf_counter() - start}
        owned = {ptr for entries in self._offloaded.values() for ptr in (e.storage.data_ptr() for e in entries)}
        for tag in tags:
            if tag in self._offloaded:
                raise OffloadedStateError(f"trainer state {tag!r} is already offloaded")
            entries, seen = [], set(owned)
            for tensor in self._tensors(tag):
                storage = tensor.untyped_storage()
                if storage.data_ptr() in seen or storage.nbytes() == 0:
                    continue
                seen.add(storage.data_ptr())
                host = None
                if tag != "grads":
                    host = self._host_buffer(tag, len(entries), storage)
                    host.untyped_storage().copy_(storage, non_blocking=False)
                entries.append(_Offloaded(storage=storage, nbytes=storage.nbytes(), host_copy=host))
                moved += storage.nbytes()
            for entry in entries:
                entry.storage.resize_(0)
            self._offloaded[tag] = entries
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # GPU only: hand the freed blocks to the driver (SGLang maps them)
        return {"offload/bytes": float(moved), "offload/seconds": time.perf_counter() - start}

    def _host_buffer(self, tag: str, index: int, storage: torch.UntypedStorage) -> torch.Tensor:
        buffers = self._host_buffers.setdefault(tag, [])
        if index < len(buffers) and buffers[index].numel() == storage.nbytes():
            return buffers[index]
        buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
        del buffers[index:]
        buffers.append(buffer)
        return buffer

    @torch.no_grad()
    def onload(self, tags: Iterable[str] | None = None) -> dict[str, float]:
        start, moved = time.perf_counter(), 0
        tags = list(tags) if tags is not None else list(self._offloaded)
        needed = sum(entry.nbytes for tag in tags for entry in self._offloaded.get(tag, []))
        problem = onload_problem(free_bytes=self.device_free_bytes() if needed else None, needed_bytes=needed,
                                 margin_bytes=self.margin_bytes)
        if problem is not None:
            raise NotEnoughDeviceMemory(problem)
        for tag in tags:
            for entry in self._offloaded.pop(tag, []):
                entry.storage.resize_(entry.nbytes)
                if entry.host_copy is None:
                    entry.storage.fill_(0)
                else:
                    entry.storage.copy_(entry.host_copy.untyped_storage(), non_blocking=False)
                moved += entry.nbytes
        return {"onload/bytes": float(moved), "onload/seconds": time.perf_counter() - start}
