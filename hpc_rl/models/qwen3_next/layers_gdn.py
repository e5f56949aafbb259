"""Megatron's own `GatedDeltaNet` (megatron/core/ssm/gated_delta_net.py), runnable on CPU and over packed samples.

Owns: `prepare_gated_delta_net()`, the switch that points the kernels Megatron's module calls (`chunk_gated_delta_rule`,
`l2norm` from flash-linear-attention, `causal_conv1d_fn` from causal-conv1d) at their CPU twins
(`gdn_kernels`) when CUDA is absent (the CPU-switch pattern of `hpc_rl.training.cpu_switch`: only device calls
change, the module, its construction and its math are Megatron's); and `PackedGatedDeltaNet`, Megatron's class with
packed (THD) micro-batches: megatron-core 0.16.1 raises NotImplementedError on `packed_seq_params`, so the subclass
runs Megatron's forward unchanged with the samples' boundaries (`cu_seqlens`) handed to the kernels, which restart
the recurrent state and the convolution window at each one (fla's `cu_seqlens`, causal-conv1d's `seq_idx`).
Does not own the layer spec (`layers`) or the kernels' math (`gdn_kernels`).

GPU-only lines (never run on this CPU machine): `_boundary_kernels` wrapping fla's `chunk_gated_delta_rule` and
causal-conv1d's `causal_conv1d_fn` (channel-last input for `seq_idx`, which causal-conv1d requires).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.ssm import gated_delta_net
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from hpc_rl.models.qwen3_next import gdn_kernels
from hpc_rl.training.cpu_switch import cuda_available

_BOUNDARIES: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("gdn_cu_seqlens", default=None)
"""The packed samples' `cu_seqlens` while a `PackedGatedDeltaNet` runs Megatron's forward (None: unpacked)."""
_prepared = False


def _with_boundaries(rule: Callable[..., Any]) -> Callable[..., Any]:
    """The gated delta rule given the packed samples' boundaries, when there are any."""

    def call(*args: Any, **kwargs: Any) -> Any:
        cu_seqlens = _BOUNDARIES.get()
        if cu_seqlens is not None:
            kwargs["cu_seqlens"] = cu_seqlens
        return rule(*args, **kwargs)

    call.__wrapped__ = rule  # type: ignore[attr-defined]
    return call


def seq_idx_of(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """causal-conv1d's `seq_idx` [1, length] (int32: each token's sample number) from `cu_seqlens`."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return (torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
            .to(torch.int32).unsqueeze(0))


def _conv_with_boundaries(conv: Callable[..., Any], *, channel_last: bool) -> Callable[..., Any]:
    """causal_conv1d_fn given the packed samples' sample index per token, when there are samples."""

    def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs: Any) -> Any:
        cu_seqlens = _BOUNDARIES.get()
        if cu_seqlens is not None:
            kwargs["seq_idx"] = seq_idx_of(cu_seqlens.to(x.device), x.shape[-1])
            if channel_last:  # causal-conv1d takes seq_idx only with channel-last x (stride 1 along channels)
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return conv(x, weight, bias, **kwargs)

    call.__wrapped__ = conv  # type: ignore[attr-defined]
    return call


def _boundary_kernels() -> None:
    """On a GPU: fla's and causal-conv1d's own kernels, given the packed samples' boundaries."""
    if gated_delta_net.chunk_gated_delta_rule is None:
        raise ImportError("Gated DeltaNet layers on GPU need flash-linear-attention (pip install "
                          "flash-linear-attention): Megatron's GatedDeltaNet calls its chunk_gated_delta_rule")
    gated_delta_net.chunk_gated_delta_rule = _with_boundaries(gated_delta_net.chunk_gated_delta_rule)
    if gated_delta_net.causal_conv1d_fn is not None:
        gated_delta_net.causal_conv1d_fn = _conv_with_boundaries(gated_delta_net.causal_conv1d_fn, channel_last=True)


def _uncompiled(method: Callable[..., Any]) -> Callable[..., Any]:
    """A `jit_fuser` (torch.compile) method's own function: inductor would compile it for the host CPU."""
    for attribute in ("_torchdynamo_orig_callable", "__wrapped__"):
        inner = getattr(method, attribute, None)
        if inner is not None:
            return _uncompiled(inner)
    return method


def prepare_gated_delta_net() -> None:
    """Make Megatron's GatedDeltaNet buildable and runnable in this process; idempotent (call before building one).

    On CPU its GPU-only kernels become their twins, and its torch.compile'd gated norm (`_apply_gated_norm`, which
    Megatron's `jit_fuser` compiles with inductor, a C++ toolchain on the host) runs as written. On GPU its kernels
    are fla's and causal-conv1d's, given the packed samples' boundaries."""
    global _prepared
    if _prepared:
        return
    if cuda_available():
        _boundary_kernels()
    else:
        gated_delta_net.HAVE_FLA = True
        gated_delta_net.l2norm = gdn_kernels.l2norm
        gated_delta_net.chunk_gated_delta_rule = _with_boundaries(gdn_kernels.chunk_gated_delta_rule)
        gated_delta_net.causal_conv1d_fn = _conv_with_boundaries(gdn_kernels.causal_conv1d_fn, channel_last=False)
        GatedDeltaNet._apply_gated_norm = _uncompiled(GatedDeltaNet._apply_gated_norm)
    _prepared = True


class PackedGatedDeltaNet(GatedDeltaNet):
    """Megatron's GatedDeltaNet that also takes packed samples (THD, one row): its forward, with the samples'
    boundaries given to the kernels. Megatron's deterministic mode runs torch's Conv1d and its own torch rule,
    which cannot restart at a boundary: packed samples are refused there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        prepare_gated_delta_net()
        super().__init__(*args, **kwargs)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any,
                packed_seq_params: Any = None, **kwargs: Any) -> Any:
        if packed_seq_params is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        if self.config.deterministic_mode:
            raise NotImplementedError("Gated DeltaNet with packed samples under deterministic_mode: Megatron's "
                                      "deterministic path (torch Conv1d, its torch gated delta rule) cannot restart "
                                      "at sample boundaries; turn deterministic mode off")
        if hidden_states.shape[1] != 1:
            raise ValueError(f"packed samples come as one row [T, 1, H], got {tuple(hidden_states.shape)}")
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        token = _BOUNDARIES.set(cu_seqlens)
        try:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            _BOUNDARIES.reset(token)
