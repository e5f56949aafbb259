"""The deepseek_v32 family's Megatron layer: deepseek_v3's MLA layer with Megatron's DSAttention (the lightning
indexer and sparse attention) as its core attention.

Owns: `layer_spec` (the family's hook). CPU (local spec): deepseek_v3's CPU MLA layer (separate q/kv latent norms,
so the q latent handed to the indexer is normalised, as DeepSeek's and transformers' `q_resid`), its core attention
`PackedDSAttention` with Megatron's `DSAIndexer` built of the `layers_dsa` twins, and `install_cpu_twins`.
GPU (Transformer Engine spec; never run here): Megatron's own `get_dsa_module_spec_for_backend` pieces, except that
the q/kv latent norms stay separate TE norms instead of being fused into the up projections: Megatron's fused form
hands the indexer the q latent before its norm (`q_compressed` is returned before TE's fused norm runs), which is not
the latent DeepSeek-V3.2's indexer was trained on.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer, DSAIndexerSubmodules, DSAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.deepseek_v3.layers import mla_layer_spec
from hpc_rl.models.deepseek_v32.layers_dsa import (
    IndexerKeyNorm, IndexerLinear, PackedDSAttention, install_cpu_twins,
)


def _te_dsa_attention(layer: ModuleSpec, k_norm: Any = None) -> None:  # GPU-only: never run on the CPU machine
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TELinear, TENorm
    from megatron.core.transformer.experimental_attention_variant import dsa

    if dsa.hadamard_transform is None:
        raise RuntimeError("DeepSeek Sparse Attention on GPU: Megatron's indexer rotates q and k with "
                           "fast_hadamard_transform, which is not installed in the trainer's environment; "
                           "install it (pip install fast-hadamard-transform) into the GPU environment")

    attention = layer.submodules.self_attention
    attention.submodules.core_attention = ModuleSpec(
        module=PackedDSAttention,
        submodules=DSAttentionSubmodules(indexer=ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
            linear_wq_b=TELinear, linear_wk=TELinear, k_norm=k_norm or TENorm, linear_weights_proj=TELinear))))
    attention.submodules.linear_q_up_proj = TEColumnParallelLinear
    attention.submodules.linear_kv_up_proj = TEColumnParallelLinear
    attention.submodules.q_layernorm = TENorm
    attention.submodules.kv_layernorm = TENorm


def layer_spec(arch: ModelArchitecture, layer: int, *, use_te: bool, moe: bool, moe_grouped_gemm: bool,
               k_norm: Any = None, te_k_norm: Any = None) -> ModuleSpec:
    """The family hook: decoder layer `layer`, MLA with DeepSeek Sparse Attention, its MLP dense or MoE. `k_norm` /
    `te_k_norm`: the indexer's key norm on CPU / under Transformer Engine (default: eps = norm_epsilon, Megatron's)."""
    spec = mla_layer_spec(arch, use_te=use_te, num_experts=arch.num_moe_experts if moe else None,
                          moe_grouped_gemm=moe_grouped_gemm)
    if use_te:
        _te_dsa_attention(spec, te_k_norm)
        return spec
    install_cpu_twins()
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=PackedDSAttention,
        submodules=DSAttentionSubmodules(indexer=ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
            linear_wq_b=IndexerLinear, linear_wk=IndexerLinear, k_norm=k_norm or IndexerKeyNorm,
            linear_weights_proj=IndexerLinear))))
    return spec
