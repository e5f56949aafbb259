"""The critic's value head is built on its model's device and in its params_dtype (a head left fp32 under a bf16
model is a GPU-only fault: the first forward mixes dtypes there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hpc_rl.training.critic import VALUE_HEAD_INIT_STD, install_value_head


class FakeGptModel(torch.nn.Module):
    """A fake of what install_value_head reads from Megatron's GPTModel: config, post_process, parameters."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=8, sequence_parallel=False, params_dtype=dtype)
        self.post_process = True
        self.share_embeddings_and_output_weights = True
        self.body = torch.nn.Linear(8, 8, dtype=dtype)
        self.output_layer = torch.nn.Linear(8, 16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_value_head_takes_the_models_dtype_and_device(dtype: torch.dtype) -> None:
    model = install_value_head(FakeGptModel(dtype), seed=3)
    head = model.output_layer
    assert {p.dtype for p in head.parameters()} == {dtype}
    assert {p.device for p in head.parameters()} == {next(model.body.parameters()).device}
    assert not model.share_embeddings_and_output_weights
    values, _ = head(torch.ones(2, 8, dtype=dtype))
    assert values.dtype == torch.float32 and values.shape == (2, 1)


def test_value_head_draw_is_the_same_in_every_dtype() -> None:
    """Every rank draws the same head from the seed whatever the dtype (drawn on the host, then cast)."""
    fp32 = install_value_head(FakeGptModel(torch.float32), seed=5).output_layer.weight
    bf16 = install_value_head(FakeGptModel(torch.bfloat16), seed=5).output_layer.weight
    assert torch.equal(fp32.to(torch.bfloat16), bf16)
    assert 0 < fp32.abs().max().item() < 10 * VALUE_HEAD_INIT_STD
