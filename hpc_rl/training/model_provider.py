"""Build a Megatron `GPTModel` from a model architecture file (`configs/models/*.yaml`).

Owns: `ModelArchitecture` + parallel sizes -> `TransformerConfig` (float32 and fusions off on CPU,
bf16 on GPU; every parameter, hpc_rl's layers' included, is built in params_dtype on its device: no cast
after), the padded vocabulary size, and `build_gpt_model`, which builds this rank's pipeline stage: the
embedding on the first stage, the final norm and output layer on the last, and the layers Megatron assigns
to the stage (an even split; `num_layers` must divide by PP). With tied
embeddings and PP > 1 the last stage holds a copy of the embedding as its output layer, made equal
to the first stage's at build time and kept equal by `finalize_model_grads` (embedding group).
Attention sinks, sliding windows, the clamped quick-GELU GLU and YaRN on GQA attention (gpt-oss) are Megatron's
own options (`attention_and_glu_fields`, `yarn_config_attributes`). MoE architectures get the architecture's routing math and the `training` section's MoE settings under
Megatron's names (`moe_config_fields`); on CPU the GPU-only kernel choices are turned off
(`cpu_switch.cpu_moe_overrides`, the same numerics) and Megatron's MoE layer is made runnable
(`cpu_switch.prepare_megatron_moe`). Does not own weights (see `hpc_rl.weights.hf_import` /
`hpc_rl.training.checkpoint`), process
groups (`parallel`) or running the stages (`pipeline`).

Vocabulary padding: the embedding is padded to a multiple of the architecture's
`make_vocab_size_divisible_by` (Megatron's flag, default `VOCAB_PAD_MULTIPLE`) and of TP, not of their product
(Megatron pads to `128 * tp`), so torch_dist checkpoints reshard between TP sizes that divide it.
The padded logits are masked out when log-probs are computed (`hpc_rl.training.logprobs`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.training.cpu_switch import (
    cpu_fusion_overrides,
    cpu_moe_overrides,
    cuda_available,
    prepare_megatron_mla,
    prepare_megatron_moe,
    tensor_cuda_is_identity,
)
from hpc_rl.config.pipeline_split import PipelineSplitError, training_split
from hpc_rl.training.layer_specs import SequenceParallelRMSNorm, build_block_spec, use_transformer_engine
from hpc_rl.training.mtp_model import MTPGPTModel, mtp_block_spec
from hpc_rl.models.qwen3_next.config_rules import transformer_config_fields
from hpc_rl.models.registry import family
from hpc_rl.models.deepseek_v32.config_rules import transformer_config_fields as dsa_config_fields

VOCAB_PAD_MULTIPLE = 128
log = logging.getLogger(__name__)
_noted: set[str] = set()


def padded_vocab_size(vocab_size: int, tp_size: int = 1, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """Vocab rows of the Megatron embedding: a multiple of `multiple` (and of tp_size)."""
    step = multiple * tp_size // math.gcd(multiple, tp_size)
    return -(-vocab_size // step) * step


def moe_config_fields(arch: ModelArchitecture, training: TrainingConfig) -> dict[str, object]:
    """TransformerConfig's MoE fields for `arch` (empty for a dense model): the architecture's routing
    math and the `training` section's MoE settings, under Megatron's names."""
    if not arch.is_moe:
        return {}
    return {
        "num_moe_experts": arch.num_moe_experts,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_topk": arch.moe_router_topk,
        "moe_layer_freq": list(arch.moe_layer_freq) if arch.moe_layer_freq is not None else 1,
        "moe_shared_expert_intermediate_size": arch.moe_shared_expert_intermediate_size,
        "moe_router_score_function": arch.moe_router_score_function,
        "moe_router_pre_softmax": arch.moe_router_pre_softmax,
        "moe_router_enable_expert_bias": arch.moe_router_enable_expert_bias,
        "moe_router_topk_scaling_factor": arch.moe_router_topk_scaling_factor,
        "moe_router_num_groups": arch.moe_router_num_groups,
        "moe_router_group_topk": arch.moe_router_group_topk,
        "moe_token_dispatcher_type": training.moe_token_dispatcher_type,
        "moe_grouped_gemm": training.moe_grouped_gemm,
        "moe_permute_fusion": training.moe_permute_fusion,
        "moe_enable_deepep": training.moe_enable_deepep,
        "moe_router_dtype": training.moe_router_dtype,
        "moe_router_load_balancing_type": training.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": training.moe_aux_loss_coeff,
        "moe_router_bias_update_rate": training.moe_router_bias_update_rate,
        "moe_token_drop_policy": training.moe_token_drop_policy,
        "moe_expert_capacity_factor": training.moe_expert_capacity_factor,
        "moe_enable_routing_replay": training.use_routing_replay or training.use_rollout_routing_replay,
        "expert_model_parallel_size": training.expert_model_parallel_size,
        "expert_tensor_parallel_size": training.expert_tensor_parallel_size,
    }


def mla_config_fields(arch: ModelArchitecture, training: TrainingConfig) -> dict[str, object]:
    """MLATransformerConfig's multi-latent-attention, YaRN and MTP fields for `arch` (empty for GQA), and the
    uneven pipeline split: YaRN when rotary_scaling_factor > 1, else plain RoPE on the rotary dims."""
    fields: dict[str, object] = {}
    if training.decoder_first_pipeline_num_layers is not None:
        fields["num_layers_in_first_pipeline_stage"] = training.decoder_first_pipeline_num_layers
    if training.decoder_last_pipeline_num_layers is not None:
        fields["num_layers_in_last_pipeline_stage"] = training.decoder_last_pipeline_num_layers
    if not arch.multi_latent_attention:
        return fields
    fields.update(
        multi_latent_attention=True, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_head_dim, qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim, v_head_dim=arch.v_head_dim,
        rope_type="yarn" if arch.yarn else "rope", rotary_base=arch.rotary_base, rotary_percent=arch.rotary_percent,
        rotary_scaling_factor=arch.rotary_scaling_factor, mscale=arch.mscale, mscale_all_dim=arch.mscale_all_dim,
        original_max_position_embeddings=arch.original_max_position_embeddings, beta_fast=arch.beta_fast,
        beta_slow=arch.beta_slow, apply_rope_fusion=False)
    if arch.mtp_num_layers:
        fields.update(mtp_num_layers=arch.mtp_num_layers, mtp_loss_scaling_factor=training.mtp_loss_scaling_factor)
    return fields


def attention_and_glu_fields(arch: ModelArchitecture) -> dict[str, object]:
    """TransformerConfig fields for attention sinks, sliding windows and the clamped quick-GELU GLU (gpt-oss; empty
    when the architecture has none): Megatron's own softmax offset, window and GLU options, under its names."""
    fields: dict[str, object] = {}
    if arch.softmax_type != "vanilla":
        fields["softmax_type"] = arch.softmax_type
    if arch.window_size:
        skip = arch.window_attn_skip_freq
        fields.update(window_size=tuple(arch.window_size),
                      window_attn_skip_freq=list(skip) if isinstance(skip, list) else skip)
    if arch.quick_geglu:
        from megatron.core.activations import quick_gelu

        fields["activation_func"] = quick_gelu
    if arch.glu_linear_offset:
        fields["glu_linear_offset"] = arch.glu_linear_offset
    if arch.activation_func_clamp_value is not None:
        fields["activation_func_clamp_value"] = arch.activation_func_clamp_value
    return fields


def uses_gqa_yarn(arch: ModelArchitecture) -> bool:
    """YaRN on grouped-query attention (GPTModel's yarn rotary: gpt-oss); MLA applies its own YaRN."""
    return arch.yarn and not arch.multi_latent_attention


def yarn_config_attributes(arch: ModelArchitecture) -> dict[str, object]:
    """The `yarn_*` attributes GPTModel's yarn rotary and the attention's cos/sin factor read off the config (with
    getattr: they are not TransformerConfig fields). mscale and mscale_all_dim None: the factor is 0.1 ln(f) + 1,
    transformers' default attention_factor."""
    if not uses_gqa_yarn(arch):
        return {}
    default_mscale = arch.mscale == 1.0 and arch.mscale_all_dim == 0.0
    return {"yarn_rotary_scaling_factor": arch.rotary_scaling_factor,
            "yarn_original_max_position_embeddings": arch.original_max_position_embeddings,
            "yarn_beta_fast": arch.beta_fast, "yarn_beta_slow": arch.beta_slow,
            "yarn_mscale": None if default_mscale else arch.mscale,
            "yarn_mscale_all_dim": None if default_mscale else arch.mscale_all_dim,
            "yarn_correction_range_round_to_int": arch.yarn_correction_range_round_to_int}


def check_moe_training(arch: ModelArchitecture, training: TrainingConfig) -> None:
    """Refuse MoE layouts Megatron cannot train, before a model is built (converters only load and save)."""
    if not arch.is_moe:
        return
    if training.tensor_model_parallel_size > 1 and not training.sequence_parallel:
        raise ValueError(f"training.tensor_model_parallel_size={training.tensor_model_parallel_size} with a MoE model "
                         f"needs training.sequence_parallel (--sequence-parallel): Megatron's MoE layer refuses to "
                         f"train under TP without it")
    if training.moe_token_dispatcher_type == "allgather" and training.expert_model_parallel_size > 1:
        raise ValueError("training.moe_token_dispatcher_type=allgather with expert_model_parallel_size > 1: Megatron's "
                         "allgather dispatcher all-gathers equal token counts over the EP group, and an EP group spans "
                         "data-parallel ranks whose micro-batches hold different numbers of tokens (gloo refuses the "
                         "sizes, NCCL would hang): use alltoall (slime's)")


def transformer_config(
    arch: ModelArchitecture,
    training: TrainingConfig,
    *,
    params_dtype: torch.dtype | None = None,
) -> TransformerConfig:
    """The TransformerConfig for `arch` under the `training` section's parallelism."""
    on_cpu = not cuda_available()
    dtype = params_dtype or (torch.float32 if on_cpu else torch.bfloat16)
    extra = cpu_fusion_overrides() if on_cpu else {}
    moe = moe_config_fields(arch, training)
    if on_cpu and moe:
        moe, notes = cpu_moe_overrides(moe)
        for note in notes:  # once per process (submit prints the user's note line; this is the trainer's log)
            if note not in _noted:
                _noted.add(note)
                log.info("%s", note)
    mla = mla_config_fields(arch, training)
    mla.update(transformer_config_fields(arch, context_parallel_size=training.context_parallel_size))
    mla.update(dsa_config_fields(arch))
    config_class = MLATransformerConfig if arch.multi_latent_attention else TransformerConfig
    extra = {**extra, **{key: mla.pop(key) for key in list(mla) if key == "apply_rope_fusion"}}
    recompute = {}
    if training.recompute_granularity:
        recompute = {
            "recompute_granularity": training.recompute_granularity,
            "recompute_method": training.recompute_method,
            "recompute_num_layers": training.recompute_num_layers,
        }
    fields = dict(gated_linear_unit=True, activation_func=F.silu)
    fields.update(attention_and_glu_fields(arch))  # sinks, sliding windows, clamped quick-GELU GLU (gpt-oss)
    config = config_class(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        qk_layernorm=arch.qk_layernorm,
        add_qkv_bias=arch.add_qkv_bias,
        add_bias_linear=arch.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rotary_interleaved=arch.rotary_interleaved,
        tensor_model_parallel_size=training.tensor_model_parallel_size,
        sequence_parallel=training.sequence_parallel,  # off at TP 1: TrainingConfig, the rule's one home
        pipeline_model_parallel_size=training.pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        context_parallel_size=training.context_parallel_size,
        calculate_per_token_loss=training.calculate_per_token_loss,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **recompute,
        **moe,
        **mla,
        **extra,
        **fields,
    )
    for name, value in yarn_config_attributes(arch).items():  # YaRN on GQA: GPTModel reads these with getattr
        setattr(config, name, value)
    return config


def build_gpt_model(
    arch: ModelArchitecture,
    training: TrainingConfig,
    *,
    params_dtype: torch.dtype | None = None,
    device: str = "cpu",
    model_class: Any = None,
) -> GPTModel:
    """This rank's pipeline stage of the GPTModel, with vocab-parallel logits on the last stage.

    `model_class`: a GPTModel subclass (or a partial of one) to build instead; default: the family's own
    (`ModelFamily.model_class`: Qwen3-VL's), else GPTModel.

    `device` is `cluster.device`: cuda builds Transformer Engine layers (and fails if TE is missing),
    cpu Megatron's local ones.
    Needs Megatron's groups (`parallel.init_parallel`) when pipeline_model_parallel_size > 1.
    """
    pipeline = training.pipeline_model_parallel_size
    try:
        training_split(arch.num_layers, training)
    except PipelineSplitError as error:
        raise ValueError(f"training.pipeline_model_parallel_size={pipeline}: {error}") from None
    config = transformer_config(arch, training, params_dtype=params_dtype)
    if arch.is_moe:
        prepare_megatron_moe()
    if arch.multi_latent_attention:
        prepare_megatron_mla()
    first, last, layers, offset = True, True, arch.num_layers, 0
    if pipeline > 1:
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        layers = get_num_layers_to_build(config)
        offset = get_transformer_layer_offset(config)
    use_te = use_transformer_engine(device)
    block = build_block_spec(arch, use_te=use_te, num_layers=layers, layer_offset=offset,
                             moe_grouped_gemm=config.moe_grouped_gemm)
    if model_class is None and family(arch.family).model_class is not None:  # a vision-language family (Qwen3-VL)
        model_class = family(arch.family).model_class(arch)
    model_class, mtp = model_class or GPTModel, {}
    if arch.mtp_num_layers:  # Megatron's MTP block, on the last stage (its default placement)
        model_class = MTPGPTModel
        if last:
            mtp["mtp_block_spec"] = mtp_block_spec(block, arch.mtp_num_layers, use_te=use_te,
                                                   norm=None if use_te else SequenceParallelRMSNorm)
    with tensor_cuda_is_identity():  # the tied output layer's init all-reduce (PP > 1) calls .cuda()
        model = model_class(
            config=config,
            transformer_layer_spec=block,
            **mtp,
            vocab_size=padded_vocab_size(arch.vocab_size, training.tensor_model_parallel_size,
                                         arch.make_vocab_size_divisible_by),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=first,
            post_process=last,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="yarn" if uses_gqa_yarn(arch) else "rope",
            rotary_percent=arch.rotary_percent,
            rotary_base=int(arch.rotary_base),
        )
    if isinstance(model, MTPGPTModel):
        model.vocab_size_unpadded = arch.vocab_size
        model.reset_mtp_metrics()
        if getattr(model, "mtp", None) is not None and not training.enable_mtp_training:
            for param in model.mtp.parameters():  # not trained: synced to the engines exactly as loaded
                param.requires_grad = False
    return model


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [1, 1, s, s] mask, True = masked (Megatron's default mask hard-codes CUDA)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def forward_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [b, s, V_padded / tp] for right-padded `tokens` [b, s] (PP=1 only;
    under PP use `pipeline.PipelineSchedule.forward_only`)."""
    batch, seq_len = tokens.shape
    position_ids = torch.arange(seq_len, device=tokens.device).unsqueeze(0).expand(batch, -1)
    return model(tokens, position_ids, causal_mask(seq_len, tokens.device))
