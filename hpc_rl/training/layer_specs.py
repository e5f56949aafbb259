"""Megatron layer specs: the block of decoder layers each family's `layer_spec` hook chooses, and the GPT layer.

Owns: `build_block_spec` (one spec per decoder layer, from the architecture's family in `hpc_rl.models`),
`gpt_layer_spec` (the GQA families' hook: Qwen3, GLM4, Llama, Qwen3-MoE, GLM-4.5 MoE), choosing the
Transformer Engine spec (`cluster.device: cuda`) or Megatron's local spec (cpu),
the RMSNorm that works with sequence parallel (Megatron's torch norm wrapper refuses SP), the
local attention that accepts packed (THD) micro-batches (Megatron's refuses them; TE has real THD
kernels, this one runs Megatron's own attention under a block-diagonal causal mask: correct, not
fast), and GLM4's
"sandwich" norms (a norm on the attention output and on the MLP output, before each residual add),
which Megatron's TransformerLayer has no slot for: they are small subclasses of `SelfAttention` and
`MLP` that normalise their own output. MoE layers are Megatron's own (`MoELayer`: TopKRouter,
SequentialMLP experts on CPU / TEGroupedMLP with grouped GEMM on GPU, SharedExpertMLP, the token
dispatcher of `moe_token_dispatcher_type`), mixed with dense layers per `moe_layer_freq`.
Does not own the TransformerConfig (`model_provider`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
)
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.registry import family
from hpc_rl.training.context_parallel import context_parallel_attention, packed_causal_mask

POST_ATTENTION_NORM = "post_self_attn_layernorm"
POST_MLP_NORM = "post_mlp_layernorm"


def use_transformer_engine(device: str) -> bool:
    """`cluster.device` -> layer spec: cuda uses Transformer Engine's (and needs it), cpu the local one."""
    if device == "cpu":
        return False
    if device != "cuda":
        raise ValueError(f"cluster.device {device!r}: use cpu or cuda")
    try:
        import transformer_engine  # noqa: F401
    except Exception as error:  # noqa: BLE001 - TE raises more than ImportError when CUDA libraries are missing
        raise RuntimeError(f"cluster.device is cuda, so the trainer builds Transformer Engine layers, but "
                           f"`import transformer_engine` failed ({type(error).__name__}: {error}): install "
                           f"transformer-engine[pytorch] for this torch/CUDA, or set cluster.device: cpu") from error
    return True


def parameter_device(config: TransformerConfig) -> torch.device:
    """Where Megatron's own layers put their parameters, so that a layer of hpc_rl's sits beside them: the host
    with `use_cpu_initialization`, else the current CUDA device (the host on a CPU-only build: cpu_switch)."""
    if config.use_cpu_initialization:
        return torch.device("cpu")
    return torch.device(torch.cuda.current_device())


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` with Megatron's constructor; marks its weight for SP grad all-reduce. Its weight has the
    config's params_dtype on Megatron's device (`parameter_device`), as Megatron's layers beside it. With the
    config's `layernorm_zero_centered_gamma` it scales by 1 + weight (the weight starts at 0), as TE's RMSNorm.

    Under sequence parallel each TP rank normalises its own slice of tokens, so the weight's
    gradient is partial per rank; `finalize_model_grads` sums grads of params flagged
    `sequence_parallel`.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, device=parameter_device(config), dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        if self.zero_centered:  # TE's RMSNorm with zero_centered_gamma (--apply-layernorm-1p): scales by 1 + weight
            torch.nn.init.zeros_(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(hidden_states)
        return torch.nn.functional.rms_norm(hidden_states, self.normalized_shape, 1 + self.weight, self.eps)


def _softmax_last_dim(scores: torch.Tensor) -> torch.Tensor:
    """softmax(scores, -1) as exp(x - max) / sum, with the max a constant (softmax does not depend on a shift)."""
    exps = (scores - scores.detach().amax(dim=-1, keepdim=True)).exp()
    return exps / exps.sum(dim=-1, keepdim=True)


class HostScaleMaskSoftmax(FusedScaleMaskSoftmax):
    """Megatron's masked softmax of the attention scores (same scale and mask function), computed as exp / sum
    where torch's fused softmax kernel is slow on the host: over a short last dimension it costs ~1 ms per
    [128, 4, 11, 11] call, fwd + bwd 1.33 ms against 0.31 ms (torch 2.13, one thread, AVX-512); the tiny run's
    train step (2 layers) went from ~26.5 to ~25.3 ms (in-process A/B). Values within 1.2e-7 of torch.softmax. Sinks
    (`softmax_offset`), float16 inputs and a call without a mask go to Megatron's own softmax."""

    @classmethod
    def of(cls, parent: FusedScaleMaskSoftmax) -> HostScaleMaskSoftmax:
        return cls(input_in_fp16=parent.input_in_fp16, input_in_bf16=parent.input_in_bf16,
                   attn_mask_type=parent.attn_mask_type, scaled_masked_softmax_fusion=parent.scaled_masked_softmax_fusion,
                   mask_func=parent.mask_func, softmax_in_fp32=parent.softmax_in_fp32, scale=parent.scale,
                   window_size=parent.window_size)

    def forward_torch_softmax(self, input: torch.Tensor, mask: torch.Tensor | None,  # noqa: A002 - Megatron's name
                              softmax_offset: torch.Tensor | None = None) -> torch.Tensor:
        if softmax_offset is not None or mask is None or self.window_size is not None or self.input_in_float16:
            return super().forward_torch_softmax(input, mask, softmax_offset)
        scores = input * self.scale if self.scale is not None else input
        return _softmax_last_dim(self.mask_func(scores, mask))


class PackedSequenceAttention(DotProductAttention):
    """Megatron's local core attention, plus THD: each packed sequence attends causally to itself only.

    With `packed_seq_params` (qkv_format "thd") SelfAttention hands over q/k/v as [T, heads, dim].
    Up to `BLOCK_MASK_MAX_TOKENS` packed tokens run as one [T, 1, heads, dim] call with a
    block-diagonal causal mask (one kernel, no Python loop; masked scores are exactly 0 after the
    softmax, so the result equals per-sequence attention); longer rows run each `cu_seqlens` span
    separately so memory stays linear in the number of sequences. Without it: the parent unchanged.
    Under context parallelism (CP group of size > 1; THD only) the rows are this rank's chunks of
    each sequence and `context_parallel.context_parallel_attention` runs them over the CP group's
    gathered K/V (the CPU twin of TE's CP attention; the parent refuses CP, so it is built with CP=1).

    Sliding windows (gpt-oss; TE and flash take `window_size` on GPU): the parent's torch softmax builds its
    window mask on "cuda" and uses it in place of the mask it is given (so a packed row would see its neighbour
    sample), so this class takes the window off the parent's softmax and adds Megatron's band (a query i sees keys
    i-left..i+right) to whatever mask the call has: causal, block-diagonal or per sequence. Attention sinks
    (softmax_type learnable) are the parent's own softmax offset, unchanged. A window under context parallelism
    is refused (the gathered K/V path has no band yet).
    """

    BLOCK_MASK_MAX_TOKENS = 2048

    def __init__(self, config: TransformerConfig, *args: Any, pg_collection: Any = None, **kwargs: Any) -> None:
        cp_group = getattr(pg_collection, "cp", None)
        context_parallel = config.context_parallel_size > 1
        if context_parallel:
            if cp_group is None:
                from megatron.core import parallel_state

                cp_group = parallel_state.get_context_parallel_group()
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, pg_collection=pg_collection, **kwargs)
        self.cp_group = cp_group
        self.window_size = self.scale_mask_softmax.window_size
        self.scale_mask_softmax.window_size = None  # the band is added to the call's mask instead (_windowed)
        self.scale_mask_softmax = HostScaleMaskSoftmax.of(self.scale_mask_softmax)
        if self.window_size is not None and context_parallel:
            raise ValueError("sliding-window attention with context parallelism on the CPU attention is not built; "
                             "use context_parallel_size 1 (or Transformer Engine on GPU)")

    def _windowed(self, mask: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor | None:
        """`mask` (True = masked, [.., sq, sk]; None = causal) with the keys outside the window masked too."""
        if self.window_size is None:
            return mask
        if mask is None:
            mask = torch.triu(torch.ones(rows, rows, dtype=torch.bool, device=device), 1)[None, None]
        left, right = self.window_size
        rows, keys = mask.shape[-2:]
        query = torch.arange(rows, device=mask.device)[:, None] + (keys - rows)
        key = torch.arange(keys, device=mask.device)[None, :]
        return mask | (key < query - left) | (key > query + right)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, self._windowed(attention_mask, query.shape[0], query.device),
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        cu_seqlens = cu_seqlens.to(query.device)
        if self.cp_group is not None and self.cp_group.size() > 1:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                return DotProductAttention.forward(self, q, k, v, mask, attn_mask_type=attn_mask_type,
                                                   attention_bias=attention_bias)

            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            return context_parallel_attention(attend, query, key, value, lengths, self.cp_group,
                                              block_mask_max_tokens=self.BLOCK_MASK_MAX_TOKENS)
        total = query.shape[0]
        if total <= self.BLOCK_MASK_MAX_TOKENS:
            mask = self._windowed(packed_causal_mask(cu_seqlens[1:].to(torch.long), total)[None, None], total,
                                  query.device)
            return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            mask = torch.triu(torch.ones(end - start, end - start, dtype=torch.bool, device=query.device), 1)
            outputs.append(super().forward(query[start:end].unsqueeze(1), key[start:end].unsqueeze(1),
                                           value[start:end].unsqueeze(1),
                                           self._windowed(mask[None, None], end - start, query.device),
                                           attn_mask_type=attn_mask_type, attention_bias=attention_bias))
        return torch.cat(outputs, dim=0)


def _post_norm(config: TransformerConfig) -> torch.nn.Module:
    return SequenceParallelRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


def _normalise_output(norm: torch.nn.Module, result: Any) -> Any:
    output, bias = result[0], result[1]
    if bias is not None:  # fold the deferred bias in: the norm must see the full output
        output = output + bias
    return (norm(output), None, *result[2:])


class PostNormSelfAttention(SelfAttention):
    """SelfAttention whose output goes through `post_self_attn_layernorm` (GLM4)."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        setattr(self, POST_ATTENTION_NORM, _post_norm(config))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _normalise_output(getattr(self, POST_ATTENTION_NORM), super().forward(*args, **kwargs))


class PostNormMLP(MLP):
    """MLP whose output goes through `post_mlp_layernorm` (GLM4)."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        setattr(self, POST_MLP_NORM, _post_norm(config))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _normalise_output(getattr(self, POST_MLP_NORM), super().forward(*args, **kwargs))


def replace_norms(spec: ModuleSpec, norm: type) -> None:
    sub = spec.submodules
    for field in ("input_layernorm", "pre_mlp_layernorm"):
        current = getattr(sub, field)
        if isinstance(current, type) and current.__name__ != "IdentityOp":
            setattr(sub, field, norm)
    attention = sub.self_attention.submodules
    for field in ("q_layernorm", "k_layernorm"):
        current = getattr(attention, field, None)
        if isinstance(current, type) and current.__name__ != "IdentityOp":
            setattr(attention, field, norm)


def gpt_layer_spec(arch: ModelArchitecture, layer: int, *, use_te: bool, moe: bool,
                   moe_grouped_gemm: bool) -> ModuleSpec:
    """Decoder layer `layer`'s spec in a GQA family: a dense MLP or (`moe`) Megatron's MoE layer (router,
    experts, shared experts and token dispatcher, all Megatron's own modules). The `layer_spec` hook of the
    GQA families (multi-latent attention: `hpc_rl.models.deepseek_v3.layers`)."""
    num_experts = arch.num_moe_experts if moe else None
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layer = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                           qk_layernorm=arch.qk_layernorm)
    else:
        # The local experts are Megatron's SequentialMLP (one MLP per local expert): grouped GEMM is a
        # GPU kernel (model_provider turns it off on CPU, with a note); the math is the same.
        layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                         qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")
        replace_norms(layer, SequenceParallelRMSNorm)
        layer.submodules.self_attention.submodules.core_attention = PackedSequenceAttention
        if num_experts is not None:
            # A MoE layer's pre-MLP norm is its own module, saved as `pre_mlp_layernorm.weight` as the
            # TE spec saves it (the local spec would file it under the dense MLP's fused-norm name,
            # which a MoE layer does not have): torch_dist checkpoints then move between CPU and GPU.
            keys = dict(layer.submodules.sharded_state_dict_keys_map)
            keys.pop("pre_mlp_layernorm.", None)
            layer.submodules.sharded_state_dict_keys_map = keys
    if arch.post_sublayer_norms:
        layer.submodules.self_attention.module = PostNormSelfAttention
        if num_experts is None:
            layer.submodules.mlp.module = PostNormMLP
        else:
            raise ValueError("post_sublayer_norms (GLM4's sandwich norms) with MoE layers is not a supported "
                             "architecture: GLM-4.5's MoE family has no post norms")
    return layer


def build_block_spec(arch: ModelArchitecture, *, use_te: bool = False, num_layers: int | None = None,
                     layer_offset: int = 0, moe_grouped_gemm: bool = False) -> TransformerBlockSubmodules:
    """Layer spec (as block submodules, so the final norm is ours too) for `arch`.

    `num_layers`: how many layers this pipeline stage builds (default: all of them), starting at the
    global layer `layer_offset`; Megatron takes a block spec's layer list as this stage's layers and
    numbers them from the stage's offset. A MoE architecture gets, per layer, the MoE layer or the
    dense one as `arch.moe_layers()` says (Megatron's moe_layer_freq pattern; GLM-4.5's first dense
    layers, Qwen3-MoE's mlp_only_layers).
    """
    final_norm: type
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = SequenceParallelRMSNorm
    count = arch.num_layers if num_layers is None else num_layers
    pattern = arch.moe_layers()
    layer_spec = family(arch.family).layer_spec
    specs = [layer_spec(arch, layer, use_te=use_te, moe=pattern[layer], moe_grouped_gemm=moe_grouped_gemm)
             for layer in range(layer_offset, layer_offset + count)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)
