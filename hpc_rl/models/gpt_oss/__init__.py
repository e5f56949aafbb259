"""gpt-oss (OpenAI's gpt-oss-20b / -120b; transformers' GptOssForCausalLM) as an hpc_rl model family.

Owns, one module each: the architecture rules and config.json check (`architecture`), slime's gpt-oss model flags
(`flags`), the HF name rows (`names`), the experts fused per layer in a weight sync (`engine_sync`: the family's
`fuse_for_engine`), reading the released checkpoints (fused bf16 experts and the MXFP4 release)
under per-expert names and the CPU engine's per-expert views (`checkpoint`), what SGLang cannot serve of it
(`serving`), and the tiny random checkpoint (`tiny`). No layer code: the layers are Megatron's own GPT layer with
its MoE MLP (`hpc_rl.training.layer_specs.gpt_layer_spec`): attention sinks are DotProductAttention's learnable softmax offset,
sliding windows its window_size / window_attn_skip_freq, the clamped SwiGLU with its linear offset Megatron's gated MLP (quick GELU, glu_linear_offset,
activation_func_clamp_value), the router and expert biases add_bias_linear, YaRN GPTModel's yarn rotary (their
TransformerConfig fields: `hpc_rl.training.model_provider.attention_and_glu_fields` / `yarn_config_attributes`).
"""

from hpc_rl.models.gpt_oss.architecture import field_problem, gpt_oss_mismatches
from hpc_rl.models.gpt_oss.engine_sync import EXPERT_FUSION
from hpc_rl.models.gpt_oss.flags import GPT_OSS_SPEC, GptOssFlags
from hpc_rl.models.gpt_oss.names import layer_rows
from hpc_rl.models.registry import ModelFamily, lazy_hook

FAMILY = ModelFamily(
    name="gpt_oss",
    hf_model_types=("gpt_oss",),
    hf_architectures=("GptOssForCausalLM",),
    moe=True,
    slime_spec=GPT_OSS_SPEC,
    description="gpt-oss (gpt-oss-20b, gpt-oss-120b; the MXFP4 release is read as bf16)",
    hf_defaults={"use_qk_norm": False, "scoring_func": "softmax", "e_score_correction_bias": False,
                 "norm_topk_prob": True, "n_shared_experts": 0},
    check_config=gpt_oss_mismatches,
    architecture_problem=field_problem,
    hf_layer_rows=layer_rows,
    make_tiny=lazy_hook("hpc_rl.models.gpt_oss.tiny:make_tiny"),
    fuse_for_engine=EXPERT_FUSION,
    hf_reader=lazy_hook("hpc_rl.models.gpt_oss.checkpoint:read_released"),
    hf_export=lazy_hook("hpc_rl.models.gpt_oss.checkpoint:released_state"),
    expert_hf_suffixes=lazy_hook("hpc_rl.models.gpt_oss.names:expert_hf_suffixes"),
    yarn_on_gqa=True,
    megatron_flags=GptOssFlags(),
    sglang_problems=lazy_hook("hpc_rl.models.gpt_oss.serving:sglang_problems"),
)
