"""slime / Megatron flags that are not hpc_rl config fields, and what each one does here.

Owns: the tables that let a slime launch line move over unchanged: Megatron's model flags
(`MODEL_ARGS`, turned into a `ModelArchitecture` by `hpc_rl.config.megatron_model`), flags accepted
because they state what hpc_rl always does (`MISC_ARGS`: no dropout, fp32 gradient reduction, ...),
aliases (`--train-async`, `--offload`, `--custom-loss-path`), flags refused with the reason and what to
use instead, and slime's plug-in import paths -> hpc_rl's equivalents. Knows nothing about YAML or argv
parsing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Megatron model flags that take values: flag name -> value type (ModelArchitecture fields are
# derived from them in hpc_rl.config.megatron_model).
MODEL_VALUE_FLAGS: dict[str, type] = {
    "num_layers": int,
    "hidden_size": int,
    "ffn_hidden_size": int,
    "num_attention_heads": int,
    "num_query_groups": int,
    "kv_channels": int,
    "vocab_size": int,
    "norm_epsilon": float,
    "rotary_base": float,
    "rotary_percent": float,
    "max_position_embeddings": int,
    "seq_length": int,
    "normalization": str,
    "position_embedding_type": str,
    "spec": list,
}
# Megatron model switches (store_true flags).
MODEL_SWITCHES = (
    "swiglu",
    "group_query_attention",
    "use_rotary_position_embeddings",
    "disable_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "rotary_interleaved",
    "untie_embeddings_and_output_weights",
    "post_self_attn_layernorm",
    "post_mlp_layernorm",
)

# --- Mixture of experts (issue 19): Megatron's MoE architecture flags, read with Megatron's meanings into
# ModelArchitecture's MoE fields (hpc_rl.config.megatron_model; --num-experts is num_moe_experts). The MoE
# training flags (--moe-token-dispatcher-type, --moe-grouped-gemm, --moe-permute-fusion, --moe-enable-deepep,
# --moe-router-dtype, --moe-router-load-balancing-type, --moe-aux-loss-coeff, --moe-router-bias-update-rate,
# --moe-token-drop-policy, --moe-expert-capacity-factor, --expert-model-parallel-size,
# --expert-tensor-parallel-size, --use-routing-replay, --use-rollout-routing-replay) and Megatron's optimizer
# offload flags (--optimizer-cpu-offload, --optimizer-offload-fraction, --overlap-cpu-optimizer-d2h-h2d,
# --use-precision-aware-optimizer) are TrainingConfig / OptimizerConfig fields under the same names.
MOE_MODEL_VALUE_FLAGS: dict[str, type] = {
    "num_experts": int,
    "moe_ffn_hidden_size": int,
    "moe_router_topk": int,
    "moe_layer_freq": object,  # an int or a list expression: hpc_rl.config.moe_layer_freq
    "moe_shared_expert_intermediate_size": int,
    "moe_router_score_function": str,
    "moe_router_topk_scaling_factor": float,
    "moe_router_num_groups": int,
    "moe_router_group_topk": int,
}
MOE_MODEL_SWITCHES = ("moe_router_pre_softmax", "moe_router_enable_expert_bias")
MODEL_VALUE_FLAGS.update(MOE_MODEL_VALUE_FLAGS)
MODEL_SWITCHES += MOE_MODEL_SWITCHES
# --- end of the MoE block

MODEL_FLAGS = frozenset(MODEL_VALUE_FLAGS) | frozenset(MODEL_SWITCHES)

# Architectures hpc_rl cannot build: flag -> reason.
UNBUILDABLE_MODEL_FLAGS: dict[str, str] = {
    "moe_shared_expert_gate": ("hpc_rl builds Qwen3-MoE and GLM-4.5 MoE models; a gated shared expert "
                               "(Qwen2-MoE, Qwen3-Next) is neither"),
    **{name: "hpc_rl has no multi-latent attention (DeepSeek MLA): use a GQA/MHA model"
       for name in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim",
                    "qk_pos_emb_head_dim")},
    "mtp_num_layers": "hpc_rl has no multi-token-prediction heads",
    "use_rope_scaling": "hpc_rl applies plain RoPE; a scaled-RoPE model (Llama 3.1 style) would train silently wrong",
    "rotary_scaling_factor": "hpc_rl applies plain RoPE; a scaled-RoPE model would train silently wrong",
    "apply_layernorm_1p": "hpc_rl builds RMSNorm models only",
}


@dataclass(frozen=True)
class CompatFlag:
    """A flag hpc_rl accepts because it states hpc_rl's own behaviour (at the accepted values only)."""

    accepted: tuple[Any, ...]
    behaviour: str


COMPAT_FLAGS: dict[str, CompatFlag] = {
    "attention_dropout": CompatFlag((0.0,), "hpc_rl trains without dropout"),
    "hidden_dropout": CompatFlag((0.0,), "hpc_rl trains without dropout"),
    "accumulate_allreduce_grads_in_fp32": CompatFlag((True,), "hpc_rl always reduces gradients in fp32"),
    "attention_softmax_in_fp32": CompatFlag(
        (True,), "the attention softmax always runs in fp32 (TE fused attention on GPU, float32 on CPU)"),
    "attention_backend": CompatFlag(
        ("flash", "auto"), "Transformer Engine picks flash attention where the GPU has it; other backends are not offered"),
    "bf16": CompatFlag((True,), "hpc_rl trains in bf16 on cuda (float32 on cpu)"),
    "no_rope_fusion": CompatFlag((True,), "hpc_rl never fuses RoPE"),
    "balance_data": CompatFlag(
        (True,), "hpc_rl always balances the DP ranks' token counts (Karmarkar-Karp), as --balance-data does"),
    "use_tensorboard": CompatFlag((True,), "TensorBoard is always written (logging.tensorboard_dir)"),
    "disable_wandb_random_suffix": CompatFlag(
        (True,), "hpc_rl never adds a random suffix to the W&B group (--wandb-group, default: the run name)"),
    "use_distributed_optimizer": CompatFlag((True,), "hpc_rl always uses Megatron's distributed optimizer on GPU"),
    "train_backend": CompatFlag(("megatron",), "hpc_rl trains with Megatron-core only"),
    "rollout_function_path": CompatFlag(
        ("slime.rollout.sglang_rollout.generate_rollout",),
        "hpc_rl's controller runs slime's default rollout; per-sample logic goes in --custom-generate-function-path"),
}

# Other spellings of hpc_rl fields: flag name -> field path (value passed through).
ALIASES: dict[str, str] = {
    "train_async": "rollout.async_rollout",
    "async": "rollout.async_rollout",
    "offload": "training.offload_train",
    "tb_project_name": "logging.run_name",
    "model_file": "model",
    "custom_loss_path": "algorithm.custom_loss_function_path",
    "custom_advantage_path": "algorithm.custom_advantage_function_path",
}

REFUSED_FLAGS: dict[str, str] = {
    "wandb_always_use_train_step": ("not offered: W&B gets the controller's per-rollout scalars against rollout/step "
                                    "(train/* of each rollout's last optimizer step); every optimizer step's train/* "
                                    "is in TensorBoard (logging.tensorboard_dir)"),
    "wandb_random_suffix": "not offered: the W&B group is --wandb-group (default: the run name), without a suffix",
    "debug_rollout_only": ("not offered: to try rollouts and rewards without training, score a file with "
                           "`python -m hpc_rl.rewards` or run with --num-rollout 1"),
    "debug_train_only": "not offered: a run always generates its own rollouts (hpc_rl has no engine-less mode)",
    "save_debug_rollout_data": ("not offered: every rollout's samples are summarised in <run_dir>/rollouts.jsonl; "
                                "there is no replay format"),
    "load_debug_rollout_data": "not offered: hpc_rl cannot replay saved rollouts; drop the flag",
    "no_load_optim": ("not offered: --load restores weights, optimizer and the rollout position together; to start "
                      "from a checkpoint's weights with a fresh optimizer, give it as --ref-load and leave --load empty"),
    "finetune": ("not offered: to start at iteration 0 from a checkpoint's weights, give it as --ref-load (or convert it "
                 "with tools/convert_torch_dist_to_hf.py for --hf-checkpoint) and leave --load empty"),
    "num_data_workers": "not needed: the controller streams the prompt file itself; there are no data workers to size",
    "rollout_max_prompt_len": ("not applied: hpc_rl does not drop over-long prompts when it loads the data; filter "
                               "the prompt file beforehand (rollout_max_context_len bounds prompt + response)"),
    "custom_pg_loss_reducer_function_path": (
        "not offered: the policy loss is reduced by sum_of_sample_mean (or per token with "
        "--calculate-per-token-loss); for another reduction write the whole loss as --loss-type custom_loss "
        "--custom-loss-function-path, which receives sum_of_sample_mean and may ignore it"),
    "offload_rollout": "not needed: colocated engines always release their memory during training",
    "no_offload_rollout": "not offered: colocated engines must release their memory for the trainer",
}

# slime's plug-in import paths -> hpc_rl's equivalents (None: hpc_rl's built-in default).
SLIME_PLUGIN_PATHS: dict[str, str | None] = {
    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std":
        "hpc_rl.rollout.filters.check_reward_nonzero_std",
    "slime.rollout.filter_hub.buffer_filters.pop_first": "hpc_rl.rollout.filters.pop_first",
    "slime.rollout.buffer.pop_first": "hpc_rl.rollout.filters.pop_first",
    "slime.rollout.sglang_rollout.generate": None,
    "slime.rollout.rm_hub.async_rm": None,
    "slime.rollout.rm_hub.batched_async_rm": None,
}
# slime reward modules given as --custom-rm-path -> the rm_type that computes the same reward here.
SLIME_RM_MODULES: dict[str, str] = {
    "slime.rollout.rm_hub.deepscaler": "deepscaler",
    "slime.rollout.rm_hub.math_dapo_utils": "dapo",
    "slime.rollout.rm_hub.math_utils": "math",
    "slime.rollout.rm_hub.f1": "f1",
    "slime.rollout.rm_hub.remote_rm": "remote_rm",
}
PLUGIN_PATH_FIELDS = ("rollout.custom_rm_path", "rollout.dynamic_sampling_filter_path", "rollout.buffer_filter_path",
                      "rollout.custom_generate_function_path")
