"""Issue 29 on CUDA: a frozen model's weights rest in pinned host memory and swap in for its pass in place of the
actor's (whose device storages are freed meanwhile), giving the result of the model resident on the GPU."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import need

pytestmark = pytest.mark.gpu


def test_frozen_weights_swap_in_from_pinned_host_memory() -> None:
    need(gpus=1)
    import torch

    from hpc_rl.training.host_weights import HostResidentModel

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    actor = torch.nn.Linear(1024, 1024, dtype=torch.bfloat16, device=device)
    frozen = torch.nn.Linear(1024, 1024, dtype=torch.bfloat16, device=device)
    x = torch.randn(8, 1024, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        expected, actor_out = frozen(x), actor(x)
    resident = torch.cuda.memory_allocated(device)
    host = HostResidentModel(frozen, actor=actor, device=device)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in frozen.parameters())
    assert torch.cuda.memory_allocated(device) < resident  # the frozen weights left the GPU
    with host.on_device() as model, torch.no_grad():
        assert all(p.untyped_storage().nbytes() == 0 for p in actor.parameters())
        assert all(p.device == device for p in model.parameters())
        assert torch.equal(model(x), expected)
    assert all(p.device.type == "cpu" for p in frozen.parameters())
    with torch.no_grad():
        assert torch.equal(actor(x), actor_out)
