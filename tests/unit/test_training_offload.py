"""Trainer offload (colocated mode) on CPU: storages freed and restored by tag, views kept, grads zeroed,
and the next optimizer step identical to one without the round trip."""

from __future__ import annotations

import pytest
import torch

from hpc_rl.training.offload import NotEnoughDeviceMemory, OffloadedStateError, TrainerOffload, onload_problem


class AdamWrapperForTest:
    """Shaped like hpc_rl's ActorOptimizer (a torch optimizer under `torch_optimizer`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.torch_optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)


def model_with_grad_buffer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    buffer = torch.zeros(sum(p.numel() for p in model.parameters()))  # one contiguous grad buffer, as Megatron DDP
    offset = 0
    for p in model.parameters():
        p.main_grad = buffer[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    return model


def step(model: torch.nn.Module, optimizer: AdamWrapperForTest, x: torch.Tensor) -> None:
    loss = model(x).square().sum()
    loss.backward()
    for p in model.parameters():
        p.main_grad.add_(p.grad)
        p.grad = p.main_grad.clone()
    optimizer.torch_optimizer.step()
    for p in model.parameters():
        p.main_grad.zero_()
        p.grad = None


def test_round_trip_keeps_training_identical() -> None:
    x = torch.randn(3, 4)
    model, reference = model_with_grad_buffer(0), model_with_grad_buffer(0)
    optimizer, reference_optimizer = AdamWrapperForTest(model), AdamWrapperForTest(reference)
    step(model, optimizer, x)
    step(reference, reference_optimizer, x)
    offload = TrainerOffload(models=[model], optimizer=optimizer)
    first = next(model.parameters())
    view = first[0]
    moved = offload.offload(["grads", "optimizer"])
    assert moved["offload/bytes"] > 0 and first.untyped_storage().nbytes() > 0
    with pytest.raises(OffloadedStateError, match="already offloaded"):
        offload.offload(["grads"])
    offload.offload(["weights"])
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(p.main_grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    state = optimizer.torch_optimizer.state[first]
    assert state["exp_avg"].untyped_storage().nbytes() == 0
    with pytest.raises(OffloadedStateError, match="offloaded"):
        offload.require_onloaded("train")
    offload.onload()
    offload.require_onloaded("train")
    assert view.data_ptr() == first.data_ptr()  # views still point into the restored storage
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, want) and torch.count_nonzero(got.main_grad) == 0
    step(model, optimizer, x)
    step(reference, reference_optimizer, x)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, want)
    offload.offload(["weights", "grads", "optimizer"])  # a second cycle reuses the host buffers
    offload.onload(["weights", "grads", "optimizer"])
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, want)
    assert torch.equal(state["exp_avg_sq"], reference_optimizer.torch_optimizer.state[next(reference.parameters())]["exp_avg_sq"])


def test_no_offload_train_keeps_the_state_on_the_device() -> None:
    """training.offload_train false (slime's --no-offload-train): the colocated commands move nothing."""
    x = torch.randn(3, 4)
    model = model_with_grad_buffer(0)
    optimizer = AdamWrapperForTest(model)
    step(model, optimizer, x)
    before = [p.detach().clone() for p in model.parameters()]
    offload = TrainerOffload(models=[model], optimizer=optimizer, enabled=False)
    moved = offload.offload(["weights", "grads", "optimizer"])
    assert moved["offload/bytes"] == 0.0 and offload.offloaded_tags == []
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert optimizer.torch_optimizer.state[next(model.parameters())]["exp_avg"].untyped_storage().nbytes() > 0
    offload.require_onloaded("train")  # nothing to onload first
    assert offload.onload()["onload/bytes"] == 0.0
    for got, want in zip(model.parameters(), before):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="unknown offload tag"):
        offload.offload(["kv_cache"])


def test_onload_keeps_the_train_memory_margin_free() -> None:
    """vime's --train-memory-margin-bytes: an onload that would leave less than the margin free on the device
    stops before it moves anything, naming the numbers (a fake free-memory probe stands in for the GPU's)."""
    model = model_with_grad_buffer(0)
    before = [p.detach().clone() for p in model.parameters()]
    needed = sum(p.untyped_storage().nbytes() for p in model.parameters())
    free = {"bytes": needed + 100}
    offload = TrainerOffload(models=[model], optimizer=AdamWrapperForTest(model), margin_bytes=1000,
                             device_free_bytes=lambda: free["bytes"])
    offload.offload(["weights"])
    with pytest.raises(NotEnoughDeviceMemory, match=r"plus the 0.00 GiB margin \(training.train_memory_margin_bytes\)"):
        offload.onload(["weights"])
    assert offload.offloaded_tags == ["weights"]  # nothing was moved back
    free["bytes"] = needed + 1000
    offload.onload(["weights"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert onload_problem(free_bytes=None, needed_bytes=10**12, margin_bytes=10**9) is None  # CPU: no device to ask
