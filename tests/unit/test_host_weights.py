"""Frozen models with host-resident weights (issue 29): during a frozen model's pass the actor's weights are in
host memory (their storages freed), the frozen model computes with its own weights, and afterwards the actor's
weights are back bit for bit in the same storages while the frozen model's are host tensors again."""

from __future__ import annotations

import torch

from hpc_rl.training.host_weights import HostResidentModel, host_bytes, move_to_host


def linear_pair(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    actor = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    frozen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    # as Megatron DDP: the actor's parameters are views into one contiguous buffer
    buffer = torch.cat([p.detach().reshape(-1) for p in actor.parameters()])
    offset = 0
    for p in actor.parameters():
        p.data = buffer[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    return actor, frozen


def test_the_frozen_pass_runs_with_the_actors_weights_out_and_gives_the_resident_result() -> None:
    actor, frozen = linear_pair(0)
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected_frozen, expected_actor = frozen(x).clone(), actor(x).clone()
    actor_before = [p.detach().clone() for p in actor.parameters()]
    host = HostResidentModel(frozen, actor=actor, device=torch.device("cpu"))
    at_rest = [p.data for p in frozen.parameters()]
    seen: dict[str, object] = {}

    def record(_module: torch.nn.Module, _inputs: object) -> None:
        seen["actor_bytes"] = sum(p.untyped_storage().nbytes() for p in actor.parameters())
        seen["copies"] = all(p.data_ptr() != r.data_ptr() for p, r in zip(frozen.parameters(), at_rest))

    frozen.register_forward_pre_hook(record)
    with host.on_device() as model, torch.no_grad():
        assert model is frozen
        swapped = model(x)
    assert seen == {"actor_bytes": 0, "copies": True}  # never both models' weights on the device
    assert torch.equal(swapped, expected_frozen)  # bit for bit the resident model's result
    assert all(p.data_ptr() == r.data_ptr() for p, r in zip(frozen.parameters(), at_rest))  # host copies again
    assert all(torch.equal(p, b) for p, b in zip(actor.parameters(), actor_before, strict=True))
    with torch.no_grad():
        assert torch.equal(actor(x), expected_actor)
    with host.on_device(), torch.no_grad():  # the actor's host buffers are reused on the next swap
        assert torch.equal(frozen(x), expected_frozen)
    assert all(torch.equal(p, b) for p, b in zip(actor.parameters(), actor_before, strict=True))


def test_an_updated_reference_takes_the_actors_weights_into_its_host_copies() -> None:
    actor, frozen = linear_pair(1)
    host = HostResidentModel(frozen, actor=actor, device=torch.device("cpu"))
    assert not all(torch.equal(p, a) for p, a in zip(frozen.parameters(), actor.parameters()))
    host.copy_from(actor)
    assert all(torch.equal(p, a) for p, a in zip(frozen.parameters(), actor.parameters()))
    assert host_bytes(frozen) == sum(p.numel() * 4 for p in actor.parameters())


def test_move_to_host_leaves_host_tensors_alone_without_pinning() -> None:
    _, frozen = linear_pair(2)
    pointers = [p.data_ptr() for p in frozen.parameters()]
    move_to_host(frozen, pin=False)
    assert [p.data_ptr() for p in frozen.parameters()] == pointers


def test_the_reference_the_teacher_and_the_colocated_offload_share_one_host_copy_of_the_actor() -> None:
    from hpc_rl.training.offload import TrainerOffload

    actor, reference = linear_pair(3)
    _, teacher = linear_pair(4)
    shared: dict[str, list[torch.Tensor]] = {}
    swaps = [HostResidentModel(m, actor=actor, device=torch.device("cpu"), actor_host_buffers=shared)
             for m in (reference, teacher)]
    colocated = TrainerOffload(models=[actor], optimizer=None, host_buffers=shared)
    before = [p.detach().clone() for p in actor.parameters()]
    for swap in swaps:
        with swap.on_device():
            pass
    colocated.offload(["weights"])
    colocated.onload(["weights"])
    assert len(shared["weights"]) == 1  # the actor's one storage (its DDP-like buffer), copied once
    assert shared["weights"][0].numel() == sum(p.numel() * 4 for p in actor.parameters())
    assert all(torch.equal(p, b) for p, b in zip(actor.parameters(), before, strict=True))
