"""The CPU twins of the Gated DeltaNet kernels (hpc_rl.models.qwen3_next.gdn_kernels): equal to transformers' torch
path (fp32, < 1e-5), the chunked form equal to the recurrent one, and packed samples equal to each sample alone
(the state and the convolution window restart at every boundary)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from hpc_rl.models.qwen3_next import gdn_kernels as twin


def inputs(batch: int, length: int, heads: int = 2, k_dim: int = 8, v_dim: int = 12, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, length, heads, k_dim, generator=generator) for _ in range(2))
    v = torch.randn(batch, length, heads, v_dim, generator=generator)
    g = -torch.rand(batch, length, heads, generator=generator) * 2  # log decay <= 0
    beta = torch.rand(batch, length, heads, generator=generator)
    return q, k, v, g, beta


def hf_reference(function, q, k, v, g, beta, **kwargs):
    """transformers' torch path, unwrapped from its kernel-hub decorator (it may swap in a hub kernel)."""
    original = getattr(function, "__wrapped__", function)
    return original(q, k, v, g, beta, **kwargs)


@pytest.mark.parametrize("length", [5, 64, 150])
def test_chunked_twin_equals_transformers_torch_path(length: int) -> None:
    q, k, v, g, beta = inputs(2, length)
    state = torch.randn(2, 2, 8, 12)
    ours, our_state = twin.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    theirs, their_state = hf_reference(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, initial_state=state,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (ours - theirs).abs().max() < 1e-5
    assert (our_state - their_state).abs().max() < 1e-5


def test_recurrent_twin_equals_transformers_and_the_chunked_form() -> None:
    q, k, v, g, beta = inputs(1, 70, seed=1)
    ours, our_state = twin.fused_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True)
    theirs, their_state = hf_reference(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (ours - theirs).abs().max() < 1e-5 and (our_state - their_state).abs().max() < 1e-5
    for chunk_size in (16, 64):
        chunked, chunked_state = twin.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
        assert (chunked - ours).abs().max() < 1e-5 and (chunked_state - our_state).abs().max() < 1e-5


@pytest.mark.parametrize("rule", [twin.chunk_gated_delta_rule, twin.fused_recurrent_gated_delta_rule])
def test_packed_samples_equal_each_sample_alone(rule) -> None:
    first, second = inputs(1, 37, seed=2), inputs(1, 70, seed=3)
    packed = [torch.cat([a, b], dim=1) for a, b in zip(first, second)]
    cu_seqlens = torch.tensor([0, 37, 107], dtype=torch.int32)
    out, states = rule(*packed, cu_seqlens=cu_seqlens, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for index, (sample, span) in enumerate(((first, slice(0, 37)), (second, slice(37, 107)))):
        alone, alone_state = rule(*sample, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert (out[:, span] - alone).abs().max() < 1e-5
        assert (states[index] - alone_state[0]).abs().max() < 1e-5
    unbounded, _ = rule(*packed, use_qk_l2norm_in_kernel=True)
    assert (unbounded[:, 37:] - out[:, 37:]).abs().max() > 1e-3  # without the boundary the second sees the first


def test_causal_conv1d_equals_transformers_and_restarts_at_boundaries() -> None:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 20, generator=generator)
    weight, bias = torch.randn(6, 4, generator=generator), torch.randn(6, generator=generator)
    theirs = hf.causal_conv1d_fn.__wrapped__(x, weight, bias, activation="silu") if hasattr(
        hf.causal_conv1d_fn, "__wrapped__") else hf.causal_conv1d_fn(x, weight, bias, activation="silu")
    assert (twin.causal_conv1d_fn(x, weight, bias, activation="silu") - theirs).abs().max() < 1e-6
    packed = torch.cat([x[:1, :, :7], x[1:, :, :13]], dim=2)
    seq_idx = torch.tensor([[0] * 7 + [1] * 13], dtype=torch.int32)
    out = twin.causal_conv1d_fn(packed, weight, bias, seq_idx=seq_idx, activation="silu")
    assert torch.equal(out, twin.causal_conv1d_fn(packed, weight, bias, activation="silu",
                                                  cu_seqlens=torch.tensor([0, 7, 20])))
    assert (out[..., :7] - twin.causal_conv1d_fn(x[:1, :, :7], weight, bias, activation="silu")).abs().max() < 1e-6
    assert (out[..., 7:] - twin.causal_conv1d_fn(x[1:, :, :13], weight, bias, activation="silu")).abs().max() < 1e-6
    unbounded = twin.causal_conv1d_fn(packed, weight, bias, activation="silu")
    assert (unbounded[..., 7:10] - out[..., 7:10]).abs().max() > 1e-3


def test_causal_conv1d_update_steps_equal_the_whole_sequence() -> None:
    generator = torch.Generator().manual_seed(5)
    x, weight = torch.randn(1, 6, 9, generator=generator), torch.randn(6, 4, generator=generator)
    whole = twin.causal_conv1d_fn(x, weight, activation="silu")
    state = torch.zeros(1, 6, 4)
    steps = [twin.causal_conv1d_update(x[..., t:t + 1], state, weight, activation="silu") for t in range(9)]
    assert (torch.cat(steps, dim=-1) - whole).abs().max() < 1e-6


def test_bad_shapes_and_batched_packing_are_refused() -> None:
    q, k, v, g, beta = inputs(2, 8)
    with pytest.raises(ValueError, match="cu_seqlens packs samples into one row"):
        twin.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="expected q, k"):
        twin.chunk_gated_delta_rule(q, k[:, :, :1], v, g, beta)


def test_megatrons_gated_delta_net_gets_the_twins_on_cpu_and_sample_indices_from_cu_seqlens() -> None:
    from megatron.core.ssm import gated_delta_net

    from hpc_rl.models.qwen3_next.layers_gdn import prepare_gated_delta_net, seq_idx_of

    prepare_gated_delta_net()
    assert gated_delta_net.HAVE_FLA and gated_delta_net.l2norm is twin.l2norm
    assert gated_delta_net.chunk_gated_delta_rule.__wrapped__ is twin.chunk_gated_delta_rule
    assert gated_delta_net.causal_conv1d_fn.__wrapped__ is twin.causal_conv1d_fn
    assert seq_idx_of(torch.tensor([0, 2, 5, 6], dtype=torch.int32), 6).tolist() == [[0, 0, 1, 1, 1, 2]]
