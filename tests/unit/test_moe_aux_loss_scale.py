"""The MoE load-balancing loss's gradient scale, which Megatron's schedule sets and hpc_rl's pipeline must."""
from __future__ import annotations

import pytest
import torch

from hpc_rl.training.moe_routing import moe_aux_loss_scale, set_moe_aux_loss_scale


def test_the_factor_is_megatrons() -> None:
    assert moe_aux_loss_scale(4, 1, False, 1000.0) == pytest.approx(0.25)  # mean over 4 micro-batches
    assert moe_aux_loss_scale(4, 2, False, 1000.0) == pytest.approx(0.5)  # times CP (DDP averages over DP x CP)
    assert moe_aux_loss_scale(4, 1, True, 800.0) == pytest.approx(1 / 800)  # per-token: / the global tokens


def test_the_aux_loss_gradient_carries_the_factor() -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    previous = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        set_moe_aux_loss_scale(4, 1, False, 100.0, device="cpu")
        hidden = torch.ones(3, requires_grad=True)
        aux = torch.tensor(2.0, requires_grad=True)
        MoEAuxLossAutoScaler.apply(hidden, aux).sum().backward()
        assert float(aux.grad) == pytest.approx(0.25)  # Megatron's default (never set) would give 1.0
        assert torch.equal(hidden.grad, torch.ones(3))
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = previous
