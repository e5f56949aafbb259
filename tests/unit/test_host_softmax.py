"""`layer_specs.HostScaleMaskSoftmax`: the CPU attention's masked softmax equals Megatron's own (values and
gradients), and the cases it does not compute itself (attention sinks, no mask) are Megatron's."""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func

from hpc_rl.training.layer_specs import HostScaleMaskSoftmax


def _megatrons(scale: float | None) -> FusedScaleMaskSoftmax:
    return FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=False, attn_mask_type=AttnMaskType.causal,
                                 scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
                                 softmax_in_fp32=True, scale=scale)


def test_masked_softmax_and_its_gradient_equal_megatrons() -> None:
    torch.manual_seed(0)
    causal = torch.triu(torch.ones(11, 11, dtype=torch.bool), 1)[None, None]
    for scale in (None, 0.5):
        megatron, host = _megatrons(scale), HostScaleMaskSoftmax.of(_megatrons(scale))
        assert type(host) is HostScaleMaskSoftmax and host.scale == scale and host.mask_func is attention_mask_func
        scores = torch.randn(3, 4, 11, 11) * 8
        upstream = torch.randn(3, 4, 11, 11)
        results = []
        for softmax in (megatron, host):
            leaf = scores.clone().requires_grad_(True)
            probs = softmax(leaf.clone(), causal)  # the mask function fills its input in place, as in the attention
            probs.backward(upstream)
            results.append((probs.detach(), leaf.grad))
        (expected, expected_grad), (probs, grad) = results
        assert (probs - expected).abs().max() < 1e-6 and (grad - expected_grad).abs().max() < 1e-6
        assert probs[0, 0, 0, 1:].abs().max() == 0  # the first query sees the first key only


def test_sinks_and_calls_without_a_mask_are_megatrons_softmax() -> None:
    host = HostScaleMaskSoftmax.of(_megatrons(None))
    scores = torch.randn(2, 4, 1, 5)
    offset = torch.zeros(4)
    with_sink = host(scores.clone(), torch.zeros(1, 1, 1, 5, dtype=torch.bool), offset)
    assert with_sink.sum(-1).max() < 1.0  # a sink takes its share: not the plain softmax
    assert torch.allclose(with_sink, _megatrons(None)(scores.clone(), torch.zeros(1, 1, 1, 5, dtype=torch.bool),
                                                      offset))
    assert torch.allclose(host(scores.clone(), None), torch.softmax(scores, -1))  # sq == 1: no mask, Megatron's
