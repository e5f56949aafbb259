"""GLM-5's Megatron layer: deepseek_v32's (MLA with Megatron's DSAttention) with three norms at eps 1e-6 while the
model's other norms use rms_norm_eps (1e-5 in GLM-5's config.json), as transformers' GlmMoeDsa builds them: the
indexer's key LayerNorm (`nn.LayerNorm(head_dim, eps=1e-6)`) and MLA's q and kv latent RMSNorms (`q_a_layernorm`,
`kv_a_layernorm`, built without an eps: their class default 1e-6). Megatron builds all three with
layernorm_epsilon. (Measured on the tiny checkpoint at rms_norm_eps 1e-5: logits 5.7e-5 off transformers' with
Megatron's eps, 1.2e-7 with these.)
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.deepseek_v32 import layers as dsa_layers
from hpc_rl.models.deepseek_v32.config_rules import INDEXER_K_NORM_EPS
from hpc_rl.models.deepseek_v32.layers_dsa import IndexerKeyNorm
from hpc_rl.training.layer_specs import SequenceParallelRMSNorm


class FixedEpsIndexerKeyNorm(IndexerKeyNorm):
    """The indexer's key LayerNorm at eps 1e-6 whatever DSAIndexer passes (its config's layernorm_epsilon)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = INDEXER_K_NORM_EPS, **kwargs: Any) -> None:
        super().__init__(config, hidden_size, eps=INDEXER_K_NORM_EPS, **kwargs)


class FixedEpsRMSNorm(SequenceParallelRMSNorm):
    """MLA's q / kv latent RMSNorm at eps 1e-6 whatever MLA passes (its config's layernorm_epsilon)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = INDEXER_K_NORM_EPS, **kwargs: Any) -> None:
        super().__init__(config, hidden_size, eps=INDEXER_K_NORM_EPS, **kwargs)


class FixedEpsTENorm:  # GPU-only: never run on the CPU machine
    """Transformer Engine's norm (Megatron's TENorm factory; LayerNorm or RMSNorm as the config says) at eps 1e-6:
    the indexer's keys, the q / kv latents."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = INDEXER_K_NORM_EPS, **kwargs: Any) -> Any:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm(config, hidden_size, eps=INDEXER_K_NORM_EPS, **kwargs)


def layer_spec(arch: ModelArchitecture, layer: int, *, use_te: bool, moe: bool, moe_grouped_gemm: bool) -> ModuleSpec:
    """The family hook: deepseek_v32's layer with the fixed-eps indexer key norm and latent norms."""
    spec = dsa_layers.layer_spec(arch, layer, use_te=use_te, moe=moe, moe_grouped_gemm=moe_grouped_gemm,
                                 k_norm=FixedEpsIndexerKeyNorm, te_k_norm=FixedEpsTENorm)
    attention = spec.submodules.self_attention.submodules
    attention.q_layernorm = attention.kv_layernorm = FixedEpsTENorm if use_te else FixedEpsRMSNorm
    return spec
