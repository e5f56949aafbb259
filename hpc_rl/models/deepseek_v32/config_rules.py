"""What a DeepSeek Sparse Attention (DSA) architecture must hold, and its config.json check: pure, no torch.

Owns: the DSA fields of `ModelArchitecture` against config.json (`check_config`, the family's hook), why an
architecture cannot be built as deepseek_v32 (`architecture_problem`) or holds DSA fields it cannot use
(`dsa_field_problem`, called by `ModelArchitecture.__post_init__`), and the Megatron `TransformerConfig` fields they
become (`transformer_config_fields`):

  ModelArchitecture (Megatron)   config.json (DeepseekV32Config)
  dsa_indexer_n_heads            index_n_heads
  dsa_indexer_head_dim           index_head_dim
  dsa_indexer_topk               index_topk
  norm_epsilon                   rms_norm_eps, which must be 1e-6: transformers' indexer k_norm is a LayerNorm with
                                 eps 1e-6 fixed, Megatron's uses layernorm_epsilon
"""

from __future__ import annotations

from typing import Any

ModelArchitecture = Any
"""A `hpc_rl.config.model.ModelArchitecture` (not imported: config imports this package)."""

DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
HF_KEY_OF_FIELD = {"dsa_indexer_n_heads": "index_n_heads", "dsa_indexer_head_dim": "index_head_dim",
                   "dsa_indexer_topk": "index_topk"}
HF_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
"""DeepseekV32Config's values for keys a config.json leaves out."""
INDEXER_K_NORM_EPS = 1e-6


def dsa_field_problem(arch: ModelArchitecture) -> str | None:
    """Why the DSA fields of any architecture cannot be built (None: they can, or are unset)."""
    given = [name for name in HF_KEY_OF_FIELD if getattr(arch, name) is not None]
    if not given:
        return None
    if arch.family not in DSA_FAMILIES:
        return (f"{given[0]} with family {arch.family!r}: DeepSeek Sparse Attention is built for the families "
                f"{', '.join(DSA_FAMILIES)}")
    missing = [name for name in HF_KEY_OF_FIELD if getattr(arch, name) is None]
    if missing:
        return f"DeepSeek Sparse Attention needs {', '.join(missing)} too (config.json's {HF_KEY_OF_FIELD[missing[0]]})"
    if not arch.q_lora_rank:
        return "DeepSeek Sparse Attention needs q_lora_rank: its indexer reads the q latent (q_a_layernorm's output)"
    if arch.dsa_indexer_head_dim <= arch.qk_pos_emb_head_dim:
        return (f"dsa_indexer_head_dim ({arch.dsa_indexer_head_dim}) must exceed qk_pos_emb_head_dim "
                f"({arch.qk_pos_emb_head_dim}): the indexer rotates that many of its dims")
    head_dim = arch.dsa_indexer_head_dim
    if head_dim & (head_dim - 1):
        return (f"dsa_indexer_head_dim ({head_dim}) must be a power of two: the indexer's Hadamard rotation "
                f"(fast_hadamard_transform) is orthogonal only then")
    if arch.dsa_indexer_topk < 1 or arch.dsa_indexer_n_heads < 1:
        return "dsa_indexer_topk and dsa_indexer_n_heads must be >= 1"
    return None


def architecture_problem(arch: ModelArchitecture) -> str | None:
    """The family's hook: a deepseek_v32 model file must describe its indexer."""
    if arch.dsa_indexer_n_heads is None:
        return (f"family {arch.family!r} uses DeepSeek Sparse Attention: set dsa_indexer_n_heads, dsa_indexer_head_dim "
                "and dsa_indexer_topk (config.json's index_n_heads, index_head_dim, index_topk)")
    if arch.mtp_num_layers:
        return (f"family {arch.family!r} with mtp_num_layers: hpc_rl has not built MTP layers with sparse attention "
                "yet; set mtp_num_layers to null (drop --mtp-num-layers)")
    return dsa_field_problem(arch)


def indexer_key_mismatches(arch: ModelArchitecture, hf: dict[str, Any]) -> list[str]:
    """config.json's index_* keys against the model file (DeepseekV32Config's defaults for absent keys)."""
    theirs = {key: hf.get(key, HF_DEFAULTS[key]) for key in HF_KEY_OF_FIELD.values()}
    return [f"{field}: the model file has {getattr(arch, field)}, config.json's {key} is {theirs[key]}"
            for field, key in HF_KEY_OF_FIELD.items() if getattr(arch, field) != theirs[key]]


def check_config(arch: ModelArchitecture, hf: dict[str, Any]) -> list[str]:
    """config.json's indexer keys against the model file, one readable line per mismatch."""
    problems = []
    model_type = hf.get("model_type")
    if model_type == "glm_moe_dsa":
        problems.append("model_type: config.json is GLM-5 (glm_moe_dsa): use family glm_moe_dsa (its indexer rotates "
                        "interleaved pairs and keeps its k_norm eps at 1e-6 whatever rms_norm_eps says)")
    elif model_type not in (None, "deepseek_v32"):
        problems.append(f"model_type: config.json's {model_type!r} is not deepseek_v32 (DeepseekV32ForCausalLM)")
    problems += indexer_key_mismatches(arch, hf)
    eps = hf.get("rms_norm_eps", 1e-6)
    if eps != INDEXER_K_NORM_EPS:
        problems.append(f"rms_norm_eps: config.json has {eps}; transformers' (and DeepSeek's) indexer k_norm uses "
                        f"{INDEXER_K_NORM_EPS} and Megatron's uses norm_epsilon, so only {INDEXER_K_NORM_EPS} agrees")
    return problems


def transformer_config_fields(arch: ModelArchitecture) -> dict[str, Any]:
    """Megatron TransformerConfig's DSA fields for `arch` (empty without an indexer). The indexer's KL loss is off
    (coefficient 0: RL trains the policy, slime freezes the indexer with --freeze-indexer)."""
    if arch.dsa_indexer_n_heads is None:
        return {}
    return {"experimental_attention_variant": "dsa", "dsa_indexer_n_heads": arch.dsa_indexer_n_heads,
            "dsa_indexer_head_dim": arch.dsa_indexer_head_dim, "dsa_indexer_topk": arch.dsa_indexer_topk,
            "dsa_indexer_loss_coeff": 0.0, "dsa_indexer_use_sparse_loss": False}


def is_indexer_parameter(name: str) -> bool:
    """A Megatron parameter of a DSA indexer (DSAttention's `core_attention.indexer.*`), under any prefix (DDP's
    `module.`, pipeline chunks, MTP layers)."""
    return ".core_attention.indexer." in f".{name}"


def training_problems(arch: ModelArchitecture, training: Any) -> list[tuple[str, str]]:
    """(config field, message) for training settings a DSA model (or --freeze-indexer) cannot run with, checked at
    submit; `training` is a `hpc_rl.config.sections.training.TrainingConfig`."""
    problems = []
    dsa = arch.dsa_indexer_n_heads is not None
    if getattr(training, "freeze_indexer", False) and not dsa:
        problems.append(("training.freeze_indexer", f"freezes a DeepSeek Sparse Attention indexer, and the model "
                         f"(family {arch.family!r}) has none (slime raises the same): drop --freeze-indexer"))
    if not dsa:
        return problems
    if training.context_parallel_size > 1:
        problems.append(("training.context_parallel_size", "DeepSeek Sparse Attention under context parallelism: "
                         "Megatron's DSAttention refuses it (megatron-core 0.16.1); use context_parallel_size 1"))
    if training.tensor_model_parallel_size > 1 and training.sequence_parallel and training.qkv_format != "bshd":
        problems.append(("training.qkv_format", "DeepSeek Sparse Attention over packed samples (thd) with sequence "
                         "parallelism is not built (the indexer gathers the sequence itself); use qkv_format bshd "
                         "or tensor_model_parallel_size 1"))
    return problems
