"""Frozen models (the reference, a Megatron distillation teacher) whose weights live in host memory and are
swapped onto the device for their forward passes: one model's weights on the GPU at a time, as in slime.

Owns:
- `move_to_host(module, pin)`: at rest, every parameter of a frozen module is a host tensor (pinned when the
  trainer runs on CUDA, so the copies in are fast and asynchronous); the device copies are freed;
- `HostResidentModel.on_device()`, the swap around a frozen model's passes:

      actor weights -> host (TrainerOffload's "weights": into its pinned buffers, device storages freed)
      frozen weights: host -> device copies          ... the frozen model's forward passes ...
      device copies dropped (the host weights stay: a frozen model does not change on the device)
      actor weights: host -> device (into the same storages: DDP's buffer views stay valid)

  so the device holds the actor's weights or the frozen model's, never both (grads and optimizer state stay);
- `HostResidentModel.copy_from(actor)`: an updated reference (slime's --ref-update-interval) takes the actor's
  weights straight into its host copies.

The frozen module itself runs its pass (the same module, the same weights, copied bit for bit), so its
log-probs are exactly those of a model resident on the device. On CPU the same calls run with pinning off:
host and device are the same memory there and the copies are real ones, so the order is what the twin tests.
Does not own which passes a frozen model runs (`step`) nor how it is built and loaded (`actor`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hpc_rl.training.offload import TrainerOffload


def _no_device_check() -> None:
    """The swap moves the trainer's own memory: the actor's weights leave before the frozen ones arrive."""
    return None


@torch.no_grad()
def move_to_host(module: torch.nn.Module, *, pin: bool) -> torch.nn.Module:
    """Every parameter of `module` becomes a host copy (pinned with `pin`); its device memory is released."""
    for param in module.parameters():
        if param.device.type == "cpu" and (param.is_pinned() or not pin):
            continue
        host = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=pin)
        host.copy_(param.data)
        param.data = host
    return module


def host_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters (its host copy, for a host-resident model)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


class HostResidentModel:
    """A frozen model whose weights live in host memory, and the actor whose weights make room for it."""

    def __init__(self, module: torch.nn.Module, *, actor: torch.nn.Module, device: torch.device,
                 actor_host_buffers: dict[str, list[torch.Tensor]] | None = None) -> None:
        self.module = module
        self.device = device
        self.pin = device.type == "cuda"  # GPU only: pinned host memory; on CPU the twin runs the same calls
        move_to_host(module, pin=self.pin)
        self.displaced = TrainerOffload(models=[actor], optimizer=None, device_free_bytes=_no_device_check,
                                        host_buffers=actor_host_buffers)
        """The actor's weights, moved to host memory while the frozen model is on the device (into
        `actor_host_buffers` when given: one host copy of the actor for every frozen model and the colocated
        offload, whose moves never overlap)."""

    def params(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    @contextmanager
    def on_device(self) -> Iterator[torch.nn.Module]:
        """The frozen module with its weights on the device and the actor's in host memory, for its passes."""
        params = self.params()
        hosts = [p.data for p in params]
        self.displaced.offload(["weights"])
        try:
            with torch.no_grad():
                for param, host in zip(params, hosts):
                    param.data = host.to(self.device, non_blocking=self.pin, copy=True)
            yield self.module
        finally:
            for param, host in zip(params, hosts):
                param.data = host  # the device copies are freed here
            self.displaced.onload(["weights"])

    @torch.no_grad()
    def copy_from(self, model: torch.nn.Module) -> None:
        """Take `model`'s current weights (same architecture, same parameter order) into the host copies."""
        for param, source in zip(self.params(), model.parameters(), strict=True):
            param.data.copy_(source.detach())
