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

from hpc_rl.models.qwen3_next.flags import SWITCH_FIELDS as _HYBRID_SWITCHES
from hpc_rl.models.qwen3_next.flags import VALUE_FLAGS as _HYBRID_VALUE_FLAGS

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
    "make_vocab_size_divisible_by": int,
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

# --- Multi-latent attention, YaRN and multi-token prediction (issue 20): Megatron's MLA flags, read with
# Megatron-LM's defaults into ModelArchitecture's MLA fields (hpc_rl.config.megatron_model). --rope-type is
# checked there (MLA rotates with YaRN; rope only at factor 1). The training side is TrainingConfig's under
# the same names: --enable-mtp-training, --mtp-loss-scaling-factor, --decoder-first-pipeline-num-layers,
# --decoder-last-pipeline-num-layers. SGLang's --sglang-speculative-* options pass through as sglang options.
MLA_MODEL_VALUE_FLAGS: dict[str, type] = {
    "q_lora_rank": int,
    "kv_lora_rank": int,
    "qk_head_dim": int,
    "qk_pos_emb_head_dim": int,
    "v_head_dim": int,
    "rotary_scaling_factor": float,
    "mscale": float,
    "mscale_all_dim": float,
    "rope_type": str,
    "mtp_num_layers": int,
}
MLA_MODEL_SWITCHES = ("multi_latent_attention",)
MODEL_VALUE_FLAGS.update(MLA_MODEL_VALUE_FLAGS)
MODEL_SWITCHES += MLA_MODEL_SWITCHES
# --- end of the MLA block

# --- gpt-oss (issue 31): Megatron's flags for attention sinks, sliding windows, the clamped quick-GELU GLU and YaRN
# on GQA attention, read by hpc_rl.models.gpt_oss.flags (which also says where slime's gpt-oss line disagrees
# with the checkpoint).
from hpc_rl.models.gpt_oss.flags import GPT_OSS_MODEL_SWITCHES, GPT_OSS_MODEL_VALUE_FLAGS  # noqa: E402

MODEL_VALUE_FLAGS.update(GPT_OSS_MODEL_VALUE_FLAGS)
MODEL_SWITCHES += GPT_OSS_MODEL_SWITCHES
# --- end of the gpt-oss block

# --- DeepSeek Sparse Attention (issue 31: DeepSeek-V3.2): Megatron's DSA flags, read into ModelArchitecture's dsa_*
# fields (hpc_rl.config.megatron_model); --experimental-attention-variant takes dsa only here.
DSA_MODEL_VALUE_FLAGS: dict[str, type] = {
    "experimental_attention_variant": str,
    "dsa_indexer_n_heads": int,
    "dsa_indexer_head_dim": int,
    "dsa_indexer_topk": int,
    "dsa_indexer_loss_coeff": float,
}
DSA_MODEL_SWITCHES = ("dsa_indexer_use_sparse_loss",)
MODEL_VALUE_FLAGS.update(DSA_MODEL_VALUE_FLAGS)
MODEL_SWITCHES += DSA_MODEL_SWITCHES
# --- end of the DSA block

# --- Hybrid linear attention (issue 31: Qwen3-Next, Qwen3.5, Qwen3.6): read into ModelArchitecture fields by
# hpc_rl.models.qwen3_next.flags (slime's --use-gated-attention is Megatron's --attention-output-gate).
MODEL_VALUE_FLAGS.update(_HYBRID_VALUE_FLAGS)
MODEL_SWITCHES += tuple(_HYBRID_SWITCHES)
# --- end of the hybrid block

MODEL_FLAGS = frozenset(MODEL_VALUE_FLAGS) | frozenset(MODEL_SWITCHES)

# Architectures hpc_rl cannot build: flag -> reason.
UNBUILDABLE_MODEL_FLAGS: dict[str, str] = {
    "use_rope_scaling": ("hpc_rl applies plain RoPE, YaRN inside multi-latent attention, or YaRN on gpt-oss "
                         "(--position-embedding-type yarn --rotary-scaling-factor 32, what its config.json says, "
                         "where slime's gpt-oss line has --use-rope-scaling --rope-scaling-factor 32); Megatron's "
                         "--use-rope-scaling is Llama 3.1's scaled RoPE, which would train silently wrong"),
}


ANY_VALUE = "any value"
"""A CompatFlag accepted whatever its value (what it configures is hpc_rl's own behaviour anyway)."""


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
    # train_backend: hpc_rl.config.fsdp_flags (megatron is hpc_rl's own; fsdp prints what it becomes)
}

# Issue 20's (MLA recipes): flags of slime's Moonlight / GLM-4.7-Flash lines that state what hpc_rl does.
COMPAT_FLAGS.update({
    "no_masked_softmax_fusion": CompatFlag(
        (True,), "hpc_rl never uses Megatron's masked-softmax fusion (Transformer Engine's attention on GPU, an "
                  "unfused float32 softmax on CPU)"),
    "no_position_embedding": CompatFlag((True,), "rotary models have no learned position embedding; hpc_rl never "
                                                 "builds one"),
    # --make-vocab-size-divisible-by is a model value flag (ModelArchitecture.make_vocab_size_divisible_by)
})

# slime's gpt-oss line (issue 31): flags that state what hpc_rl does.
COMPAT_FLAGS.update({
    "use_mcore_models": CompatFlag((True,), "hpc_rl always builds Megatron-core models"),
    "tokenizer_type": CompatFlag(("HuggingFaceTokenizer",), "hpc_rl reads the checkpoint's HF tokenizer"),
    "no_bias_gelu_fusion": CompatFlag((True,), "hpc_rl never fuses bias and activation (Megatron-core's default)"),
    "no_bias_dropout_fusion": CompatFlag((True,), "hpc_rl never fuses bias and dropout (Megatron-core's default)"),
})

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
    "load_debug_rollout_data": "not offered: hpc_rl cannot replay saved rollouts; drop the flag",
    "no_load_optim": ("not offered: --load restores weights, optimizer and the rollout position together; to start "
                      "from a checkpoint's weights with a fresh optimizer, give it as --ref-load and leave --load empty"),
    "finetune": ("not offered: to start at iteration 0 from a checkpoint's weights, give it as --ref-load (or convert it "
                 "with tools/convert_torch_dist_to_hf.py for --hf-checkpoint) and leave --load empty"),
    "num_data_workers": "not needed: the controller streams the prompt file itself; there are no data workers to size",
    "custom_pg_loss_reducer_function_path": (
        "not offered: the policy loss is reduced by sum_of_sample_mean (or per token with "
        "--calculate-per-token-loss); for another reduction write the whole loss as --loss-type custom_loss "
        "--custom-loss-function-path, which receives sum_of_sample_mean and may ignore it"),
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
    # Training modes: slime's on-policy-distillation reward (teacher log-probs come from the teacher client; the
    # task reward is slime's post-process's 0.0). hpc_rl.config.training_modes derives the teacher URL.
    "slime.rollout.on_policy_distillation.reward_func": "hpc_rl.rollout.teacher.distillation_reward",
    "slime.rollout.on_policy_distillation.post_process_rewards": "hpc_rl.rollout.teacher.distillation_post_process",
    # vime (slime on vLLM): its default generate function
    "vime.rollout.vllm_rollout.generate": None,
}
SLIME_FORK_PREFIXES = ("vime.",)
"""Forks of slime whose modules mirror slime's (`vime.rollout.filter_hub...` is `slime.rollout.filter_hub...`)."""


def as_slime_module_path(value: str) -> str | None:
    """`value` as slime's import path (a fork's prefix replaced), or None when it is neither slime's nor a fork's."""
    if value.startswith("slime."):
        return value
    fork = next((p for p in SLIME_FORK_PREFIXES if value.startswith(p)), None)
    return "slime." + value[len(fork):] if fork else None
# slime reward modules given as --custom-rm-path -> the rm_type that computes the same reward here.
SLIME_RM_MODULES: dict[str, str] = {
    "slime.rollout.rm_hub.deepscaler": "deepscaler",
    "slime.rollout.rm_hub.math_dapo_utils": "dapo",
    "slime.rollout.rm_hub.math_utils": "math",
    "slime.rollout.rm_hub.f1": "f1",
    "slime.rollout.rm_hub.remote_rm": "remote_rm",
}
PLUGIN_PATH_FIELDS = ("rollout.custom_rm_path", "rollout.dynamic_sampling_filter_path", "rollout.buffer_filter_path",
                      "rollout.custom_generate_function_path", "rollout.custom_reward_post_process_path")


# ---- The rest of slime's arguments.py (issues 25/26): every flag of hpc_rl/config/slime_arguments.tsv is a
# config field, an alias, accepted at hpc_rl's behaviour, or refused with the reason. Flags owned by other
# issues (MoE, MTP, SFT/OPD/critic) are theirs.
SLIME_REST_COMPAT: dict[str, CompatFlag] = {
    "use_fault_tolerance": CompatFlag(
        (True,), "hpc_rl always health-checks its engines, takes a failed one out of the router, re-queues its "
                 "samples and restarts it (controller.max_engine_restarts); the --rollout-health-check-* flags "
                 "set the checks"),
    "offload_rollout": CompatFlag((True,), "colocated engines always release their memory while the trainer works"),
    "distributed_backend": CompatFlag(("nccl", "gloo"), "hpc_rl uses NCCL on cuda and gloo on cpu (cluster.device)"),
    "rollout_data_transport": CompatFlag(
        ("object-store",), "the controller sends rollout data to the trainer ranks over its own TCP protocol "
                           "(arrays as raw bytes); there is no Ray object store, NIXL or straw queue (rollout records and "
                           "the partial buffer live in the run directory on the shared filesystem)"),
    "eval_function_path": CompatFlag(
        ("slime.rollout.sglang_rollout.generate_rollout", "vime.rollout.vllm_rollout.generate_rollout"),
        "hpc_rl's controller runs slime's default eval rollout; per-sample logic goes in --custom-generate-function-path"),
    "rollout_skip_special_tokens": CompatFlag(
        (True,), "hpc_rl's engines drop special tokens from the response text rewards read (SGLang's default)"),
    "data_source_path": CompatFlag(
        ("slime.rollout.data_source.RolloutDataSourceWithBuffer", "vime.rollout.data_source.RolloutDataSourceWithBuffer"),
        "the controller draws prompts from --prompt-data (a checkpointed cursor, shuffled per epoch) after the "
        "partial-rollout buffer, as slime's default data source does; another data source class is not offered"),
    "data_pad_size_multiplier": CompatFlag(
        (128,), "hpc_rl pads packed micro-batches itself (to the TP size under sequence parallelism, 2*CP under "
                "context parallelism); the padding does not change the loss"),
}
SLIME_REST_REFUSED: dict[str, str] = {
    "allgather_cp": ("not offered: hpc_rl's context parallelism splits packed sequences with Megatron's ring "
                     "attention; drop it"),
    "release_train": ("not offered: hpc_rl keeps the trainer processes and offloads their memory while engines "
                      "generate (training.offload_train); recreating them every step is not needed"),
    "use_stateless_adam": "not offered: hpc_rl's optimizers are Megatron's Adam/SGD with their state; drop it",
    "load_forge_rollout_data": "not offered: hpc_rl cannot replay saved rollouts; drop it",
    "load_debug_rollout_data_subsample": "not offered: hpc_rl cannot replay saved rollouts (--load-debug-rollout-data)",
    "memory_snapshot_dir": ("not offered: hpc_rl records no CUDA memory snapshots; use torch.cuda.memory's recorder "
                            "in a --custom-megatron-init-path hook"),
    "memory_snapshot_num_steps": "not offered: hpc_rl records no CUDA memory snapshots",
    "record_memory_history": "not offered: hpc_rl records no CUDA memory snapshots",
    "memory_recorder": "not offered: hpc_rl records no CUDA memory snapshots",
    "profile_target": "not offered: hpc_rl has no built-in profiler; run the trainer under nsys or torch.profiler",
    "use_distributed_post": ("not offered: hpc_rl's controller sends every request itself over keep-alive "
                             "connections; there are no Ray actors to spread the posts over: drop it"),
    "rollout_buffer_url": ("not offered: slime's external rollout-buffer server; put agent/multi-turn logic in "
                           "--custom-generate-function-path"),
    "fetch_trajectory_retry_times": "belongs to slime's rollout-buffer server (--rollout-buffer-url), not offered",
    "rollout_task_type": "belongs to slime's rollout-buffer server (--rollout-buffer-url), not offered",
    "min_batch_collection_ratio": "belongs to slime's rollout-buffer server (--rollout-buffer-url), not offered",
    "megatron_deepgemm_forward_layers": "GPU kernel selection (DeepGEMM block-FP8) hpc_rl does not offer; drop it",
    "megatron_deepgemm_forward_modules": "GPU kernel selection (DeepGEMM block-FP8) hpc_rl does not offer; drop it",
    "megatron_deepgemm_moe_forward_layers": "GPU kernel selection (DeepGEMM block-FP8) hpc_rl does not offer; drop it",
    "megatron_deepgemm_moe_forward_modules": "GPU kernel selection (DeepGEMM block-FP8) hpc_rl does not offer; drop it",
    "ci_test": "slime's own CI switch; hpc_rl's tests are tools/run_tests.sh: drop it",
    "ci_disable_kl_checker": "slime's own CI switch; drop it",
    "ci_train_rollout_logprob_abs_diff_threshold": "slime's own CI switch; drop it",
    "ci_save_grad_norm": "slime's own CI switch; drop it",
    "ci_load_grad_norm": "slime's own CI switch; drop it",
    "async_save": ("not offered: hpc_rl writes each checkpoint synchronously and commits it atomically (every rank "
                   "done, then the tracker), so a preempted job never leaves a half-written one; drop it"),
    "disable_rollout_global_dataset": ("not offered: the controller always draws prompts from --prompt-data; a "
                                       "rollout function that manages its own data is not offered (per-sample logic "
                                       "goes in --custom-generate-function-path)"),
    "check_weight_update_equal": ("not offered: hpc_rl's tests check that engines serve the trainer's weights "
                                  "(engine and trainer log-probs equal on a tiny model); drop it"),
    **{name: ("belongs to --update-weight-mode delta, which hpc_rl does not offer (it needs slime's SGLang patches: "
              "/pull_weights and per-host local checkpoints); full syncs over --update-weight-transport disk or nccl "
              "need none of it: drop it")
       for name in ("update_weight_delta_encoding", "update_weight_delta_checksum", "update_weight_local_checkpoint_dir")},
    "custom_convert_samples_to_train_data_path": (
        "not offered: the controller packs samples for the trainer itself (tokens, loss masks, rollout log-probs, "
        "weight versions); change samples with --rollout-sample-hook-path or --rollout-sample-filter-path and "
        "rewards with --custom-reward-post-process-path"),
    "padded_vocab_size": ("hpc_rl pads the vocabulary itself (to a multiple of 128 x TP, Megatron's rule) and masks "
                          "the padded logits; drop it"),
}
APPENDED_FIELDS = ("rollout.rollout_sample_hook_path",)
EXPANDING_FLAGS: dict[str, tuple[tuple[str, str], ...]] = {
    "dump_details": (("logging.save_debug_rollout_data", "{}/rollout_data/{{rollout_id}}.jsonl"),
                     ("training.save_debug_train_data", "{}/train_data/{{rollout_id}}_{{rank}}.pt")),
}
"""slime flags that set several fields (slime's --dump-details DIR: the rollout and train dumps under DIR):
flag -> (field path, value template with the flag's value for {})."""
"""Fields of slime's `action="append"` flags: each occurrence (and each YAML list) adds to the list."""
SLIME_REST_COMPAT["qwen_gdn_backend"] = CompatFlag(
    ("fla",), "hpc_rl's Gated DeltaNet layers (Megatron's GatedDeltaNet) call flash-linear-attention's "
              "chunk_gated_delta_rule on GPU (its CPU twin, hpc_rl.models.qwen3_next.gdn_kernels, on CPU); "
              "FlashQLA is not offered")
SLIME_REST_ALIASES: dict[str, str] = {
    "rollout_health_check_interval": "controller.engine_health_interval",
    "rollout_health_check_timeout": "controller.engine_health_timeout",
    "rollout_health_check_first_wait": "controller.engine_health_first_wait",
}
COMPAT_FLAGS.update(SLIME_REST_COMPAT)
REFUSED_FLAGS.update(SLIME_REST_REFUSED)
ALIASES.update(SLIME_REST_ALIASES)

# ---- Issue 34: what slime's main added after the list's commit (624b824a, 2026-08-21). Each flag is a config
# field, accepted at hpc_rl's behaviour, or refused with the reason; the walk tries each one
# (tests/unit/test_slime_flag_walk.py, SLIME_LATER_FLAGS in hpc_rl.config.slime_flag_list).
_STRAW_REASON = ("belongs to slime's straw rollout-data transport (a lease queue of packed rollout files on a "
                 "JuiceFS store); hpc_rl's controller keeps rollout records and the partial-rollout buffer in its own "
                 "run directory on the shared filesystem (run_dir) and sends rollout data to the trainer over its "
                 "TCP protocol: drop it")
SLIME_LATER_REFUSED: dict[str, str] = {
    **{name: _STRAW_REASON for name in (
        "rollout_storage_declaration", "rollout_queue_run_id", "rollout_queue_online_gc",
        "rollout_queue_lease_seconds", "rollout_queue_segment_mib", "rollout_io_concurrency")},
}
SLIME_LATER_COMPAT: dict[str, CompatFlag] = {
    "rollout_data_dir": CompatFlag((ANY_VALUE,), (
        "what straw's pool under it holds (prompt tasks, partial rollouts, finished samples, batches to replay) "
        "hpc_rl keeps in its own run directory on the shared filesystem: rollout records, the partial-rollout "
        "buffer and the checkpointed controller state under run_dir; the directory given is not used")),
    "rollout_storage_profile": CompatFlag(("local",), (
        "hpc_rl's run directory is a plain POSIX directory on the shared filesystem (straw's 'local' profile); "
        "the JuiceFS profile declares a JuiceFS mount straw checks, which hpc_rl does not use")),
}
COMPAT_FLAGS.update(SLIME_LATER_COMPAT)
SLIME_LATER_UNBUILDABLE: dict[str, str] = {}
"""--use-gated-attention, the one flag here once, is a model switch now (the hybrid block above)."""
# --post-self-attn-layernorm and --post-mlp-layernorm are model switches (MODEL_SWITCHES) already.
REMOVED_BY_SLIME: dict[str, str] = {
    name: "slime removed this flag after 2026-08-21; hpc_rl still takes it from older launch lines"
    for name in ("update_weights_interval", "keep_old_actor", "disable_rollout_global_dataset", "profile_target")
}
"""Flags slime's later main no longer defines: hpc_rl answers them as before (a field or a refusal) with this note."""
REFUSED_FLAGS.update(SLIME_LATER_REFUSED)
UNBUILDABLE_MODEL_FLAGS.update(SLIME_LATER_UNBUILDABLE)
