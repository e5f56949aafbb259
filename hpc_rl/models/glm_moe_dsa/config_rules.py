"""GLM-5's config.json check (the family's `check_config` hook): pure, no torch.

The indexer's keys as deepseek_v32's (`index_n_heads`, `index_head_dim`, `index_topk`); every layer must run its own
indexer: transformers' `indexer_types` (from config.json's `indexer_types`, `index_topk_pattern`, or
`index_topk_freq` / `index_skip_topk_offset`; all "full" by default) with a "shared" layer (IndexShare: the layer
reuses the previous full layer's top-k) is refused, because Megatron's DSAttention has no layer without an indexer.
No rms_norm_eps rule: the indexer's key norm is built at 1e-6 whatever norm_epsilon is (hpc_rl.models.glm_moe_dsa.
layers), as transformers' is.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.models.deepseek_v32.config_rules import indexer_key_mismatches


def indexer_types(hf: dict[str, Any]) -> list[str]:
    """Per layer "full" or "shared", as transformers 5.24's GlmMoeDsaConfig derives it."""
    if isinstance(hf.get("indexer_types"), list):
        return list(hf["indexer_types"])
    layers = int(hf.get("num_hidden_layers", 0))
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(layers)]


def check_config(arch: Any, hf: dict[str, Any]) -> list[str]:
    """config.json against a glm_moe_dsa model file, one readable line per mismatch."""
    problems = []
    if hf.get("model_type") not in (None, "glm_moe_dsa"):
        problems.append(f"model_type: config.json's {hf.get('model_type')!r} is not glm_moe_dsa (GlmMoeDsaForCausalLM)")
    problems += indexer_key_mismatches(arch, hf)
    shared = [layer for layer, kind in enumerate(indexer_types(hf)) if kind == "shared"]
    if shared:
        problems.append(f"indexer_types: layers {shared[:6]}{' ...' if len(shared) > 6 else ''} are 'shared' "
                        f"(IndexShare: they reuse the previous full layer's top-k); Megatron's DSAttention runs its "
                        f"own indexer in every layer, so hpc_rl builds GLM-5 with every layer 'full' only")
    return problems
