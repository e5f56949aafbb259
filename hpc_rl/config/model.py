"""Model architecture files (`configs/models/*.yaml`) and their agreement with HF `config.json`.

Owns: the `ModelArchitecture` dataclass (what Megatron needs to build a GPTModel) and loading it from
YAML. Its `family` is a registered model family (`hpc_rl.models`); the comparison with a HuggingFace
checkpoint's `config.json` is `hpc_rl.models.hf_checks.architecture_mismatches` (re-exported here). Does not
build models (that is `hpc_rl.training.model_provider`) and does not map weights (that is `hpc_rl.weights`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from hpc_rl.config.moe_layer_freq import LayerFreqError, expand_layer_freq
from hpc_rl.models.deepseek_v32.config_rules import dsa_field_problem
from hpc_rl.models.hf_checks import architecture_mismatches
from hpc_rl.models.mla import mla_field_problem
from hpc_rl.models.qwen3_next.config_rules import expand_linear_attention_freq, hybrid_field_problem
from hpc_rl.models.registry import all_families, family, family_names

__all__ = ["ModelArchitecture", "architecture_mismatches", "load_hf_config", "moe_family_names"]

MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(kw_only=True)
class ModelArchitecture:
    """A decoder-only transformer, in Megatron's terms (names follow Megatron's TransformerConfig)."""

    family: str
    """The model family (`hpc_rl/models/<family>/`): qwen3 | glm4 | llama | qwen3_moe | glm4_moe | deepseek_v3 |
    glm4_moe_lite | any other registered one (the HF model_type of the checkpoint: Qwen3MoeForCausalLM,
    Glm4MoeForCausalLM, DeepseekV3ForCausalLM, Glm4MoeLiteForCausalLM)."""
    num_layers: int
    """Number of transformer layers (HF num_hidden_layers)."""
    hidden_size: int
    """Model width (HF hidden_size)."""
    ffn_hidden_size: int
    """MLP inner width (HF intermediate_size)."""
    num_attention_heads: int
    """Query heads (HF num_attention_heads)."""
    num_query_groups: int
    """KV heads / GQA groups (HF num_key_value_heads)."""
    kv_channels: int
    """Head dimension (HF head_dim); may differ from hidden_size / num_attention_heads."""
    vocab_size: int
    """Tokenizer vocabulary size as in HF config.json (Megatron pads it for TP)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron's --make-vocab-size-divisible-by: the trainer's embedding (and output layer) has the vocabulary
    padded to a multiple of this (and of TP); the padded logits are masked. 128 (Megatron's default) suits GPU
    kernels; a tiny vocabulary on CPU trains faster unpadded (configs/models/tiny_qwen3.yaml: 8). A torch_dist
    checkpoint loads only into the padding it was saved with."""
    rotary_base: float = 10000.0
    """RoPE theta (HF rope_theta). A wrong value trains silently wrong."""
    rotary_percent: float = 1.0
    """Fraction of the head dim that is rotated (GLM4: 0.5)."""
    rotary_interleaved: bool = False
    """Interleaved (GPT-J style) rotary pairs instead of half-split (GLM4: true)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (HF rms_norm_eps), also used by the q/k norms."""
    tie_word_embeddings: bool = False
    """Output layer shares the input embedding (Qwen3 0.6B-4B: true)."""
    qk_layernorm: bool = False
    """RMSNorm on per-head queries and keys (Qwen3: true)."""
    add_qkv_bias: bool = False
    """Bias on the fused QKV projection (GLM4: true)."""
    add_bias_linear: bool = False
    """Bias on every other linear layer."""
    post_sublayer_norms: bool = False
    """Extra norms after attention and after the MLP (GLM4 'sandwich' norms)."""
    max_position_embeddings: int = 4096
    """Longest sequence the rotary tables are built for."""

    # Mixture of experts (Megatron's TransformerConfig names; slime's --num-experts is num_moe_experts).
    # Only what changes the forward's math is architecture; aux-loss, dispatcher and kernel choices are
    # training settings.
    num_moe_experts: int | None = None
    """Routed experts per MoE layer (HF num_experts / n_routed_experts); None: a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one routed expert (HF moe_intermediate_size)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF num_experts_per_tok)."""
    moe_layer_freq: list[int] | None = None
    """Per layer: 1 = MoE MLP, 0 = dense MLP of ffn_hidden_size (None: every layer is MoE). Megatron's other
    spellings (an int N: every N-th layer; slime's `[0]*1+[1]*45`) are expanded to this list on load; GLM-4.5's first_k_dense_replace and Qwen3-MoE's
    mlp_only_layers / decoder_sparse_step are this list."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert(s), all shared experts fused (HF n_shared_experts x
    moe_intermediate_size); None: no shared expert."""
    moe_router_score_function: str = "softmax"
    """softmax (Qwen3-MoE) | sigmoid (GLM-4.5, DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """softmax over all experts before top-k (HF norm_topk_prob false); false: top-k, then softmax
    over the chosen (HF norm_topk_prob true). Sigmoid routers normalise the chosen scores when top-k > 1."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only (HF e_score_correction_bias;
    aux-loss-free load balancing)."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiplier of the routing weights (HF routed_scaling_factor)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: expert groups (HF n_group; DeepSeek-V3)."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: groups each token may use (HF topk_group)."""

    # Multi-latent attention, YaRN and multi-token prediction (issue 20; Megatron's MLATransformerConfig
    # names: hpc_rl.models.mla documents the HF keys each one is checked against).
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (Megatron's MLASelfAttention) instead of GQA; kv_channels and
    num_query_groups are then unused."""
    q_lora_rank: int | None = None
    """Rank of the query's low-rank projection (HF q_lora_rank; None: one full q projection, Moonlight)."""
    kv_lora_rank: int | None = None
    """Rank of the compressed key/value latent (HF kv_lora_rank)."""
    qk_head_dim: int | None = None
    """Per-head query/key width without rotary (HF qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int | None = None
    """Per-head rotary query/key width (HF qk_rope_head_dim)."""
    v_head_dim: int | None = None
    """Per-head value width (HF v_head_dim)."""
    rotary_scaling_factor: float = 1.0
    """YaRN's scaling factor (HF rope_scaling factor); 1.0: plain RoPE."""
    mscale: float = 1.0
    """YaRN's mscale (HF rope_scaling mscale): scales the rotary cos/sin with mscale_all_dim."""
    mscale_all_dim: float = 0.0
    """YaRN's mscale_all_dim (HF rope_scaling mscale_all_dim): also scales the softmax."""
    original_max_position_embeddings: int = 4096
    """YaRN's pre-training context (HF rope_scaling original_max_position_embeddings)."""
    beta_fast: float = 32.0
    """YaRN's beta_fast (HF rope_scaling beta_fast)."""
    beta_slow: float = 1.0
    """YaRN's beta_slow (HF rope_scaling beta_slow)."""
    mtp_num_layers: int | None = None
    """Multi-token-prediction layers after the decoder (Megatron's MTP block; HF num_nextn_predict_layers,
    the layers model.layers.<num_layers + k>.* SGLang's EAGLE/NextN draft loads); None: none built."""

    # DeepSeek Sparse Attention (issue 31: DeepSeek-V3.2 / GLM-5; Megatron's TransformerConfig names, checked against
    # config.json's index_n_heads / index_head_dim / index_topk by hpc_rl.models.deepseek_v32).
    dsa_indexer_n_heads: int | None = None
    """Heads of the lightning indexer that picks each query's keys (HF index_n_heads); None: dense MLA."""
    dsa_indexer_head_dim: int | None = None
    """Width of an indexer head, its first qk_pos_emb_head_dim rotated (HF index_head_dim)."""
    dsa_indexer_topk: int | None = None
    """Keys each query attends to (HF index_topk)."""

    # Hybrid linear attention (issue 31: Qwen3-Next, Qwen3.5, Qwen3.6; Megatron's TransformerConfig names;
    # hpc_rl.models.qwen3_next.config_rules documents the config.json keys each is checked against).
    layernorm_zero_centered_gamma: bool = False
    """Every RMSNorm scales by 1 + weight (Megatron's --apply-layernorm-1p; Qwen3-Next/Qwen3.5's RMSNorm). The gated
    norm inside a Gated DeltaNet layer scales by its weight as stored, as in HF."""
    attention_output_gate: bool = False
    """Full attention's output is multiplied by sigmoid(a per-head gate) from the q projection (Megatron's
    --attention-output-gate, slime's --use-gated-attention; HF q_proj rows [q_h | gate_h] per head)."""
    moe_shared_expert_gate: bool = False
    """The shared expert's output is multiplied by sigmoid(x . w) (HF mlp.shared_expert_gate)."""
    linear_attention_freq: list[int] | None = None
    """Per layer: 1 = Gated DeltaNet linear attention, 0 = full attention (HF layer_types); None: none. Megatron's int
    N (every N-th layer full attention) is expanded to this list on load."""
    linear_conv_kernel_dim: int | None = None
    """Width of the causal convolution over q/k/v in a linear-attention layer (HF linear_conv_kernel_dim)."""
    linear_key_head_dim: int | None = None
    """Query/key head width of linear attention (HF linear_key_head_dim)."""
    linear_value_head_dim: int | None = None
    """Value head width of linear attention (HF linear_value_head_dim)."""
    linear_num_key_heads: int | None = None
    """Query/key heads of linear attention (HF linear_num_key_heads)."""
    linear_num_value_heads: int | None = None
    """Value heads of linear attention, a multiple of the key heads (HF linear_num_value_heads)."""

    # gpt-oss (issue 31; Megatron's TransformerConfig names; hpc_rl.models.gpt_oss checks them against config.json).
    softmax_type: str = "vanilla"
    """Megatron's attention softmax: vanilla | learnable (a learnable per-head sink logit in the softmax's
    denominator: gpt-oss's `self_attn.sinks`)."""
    window_size: list[int] | None = None
    """Sliding-window attention as Megatron's (left, right): a query attends keys i-left..i+right (HF
    sliding_window W is [W - 1, 0]); None: full attention everywhere."""
    window_attn_skip_freq: int | list[int] | None = None
    """Which layers use the window (Megatron's): an int N: every N-th layer is full (gpt-oss: 2, layers 1, 3, ...
    full); a list: 1 = windowed, per layer; None with window_size: every layer windowed."""
    quick_geglu: bool = False
    """The gated MLP's activation is quick GELU x * sigmoid(1.702 x) (Megatron's --quick-geglu) instead of SiLU."""
    glu_linear_offset: float = 0.0
    """Added to the gated MLP's linear half before the product (gpt-oss: 1.0, `(up + 1) * glu`)."""
    activation_func_clamp_value: float | None = None
    """Clamp of the gated MLP's inputs (gpt-oss's swiglu_limit): the gate half above, the linear half both sides."""
    yarn_correction_range_round_to_int: bool = True
    """YaRN rounds its correction range to whole dims (HF rope_parameters truncate; gpt-oss: false)."""
    vision_config: dict[str, Any] | None = None
    """Vision-language families (qwen3_vl, qwen3_vl_moe): config.json's vision_config, plus its top-level
    image_token_id and text_config.rope_parameters.mrope_section (`hpc_rl.models.qwen3_vl.names.vision_fields`)."""

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def yarn(self) -> bool:
        """YaRN rotary scaling is on (a factor above 1)."""
        return self.rotary_scaling_factor > 1.0

    def moe_layers(self) -> list[bool]:
        """Per layer: True if its MLP is a MoE layer (all False for a dense model)."""
        if not self.is_moe:
            return [False] * self.num_layers
        if self.moe_layer_freq is None:
            return [True] * self.num_layers
        return [bool(flag) for flag in self.moe_layer_freq]

    def __post_init__(self) -> None:
        if self.family not in family_names():
            raise ValueError(f"family: {self.family!r} is not one of {', '.join(family_names())}")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by ({self.make_vocab_size_divisible_by}) must be >= 1")
        if family(self.family).moe and not self.is_moe:
            raise ValueError(f"family {self.family!r} is a mixture-of-experts family: set num_moe_experts")
        if self.is_moe:
            if not family(self.family).moe:
                raise ValueError(f"family {self.family!r} is dense but num_moe_experts is set: a mixture-of-experts "
                                 f"model is one of {', '.join(moe_family_names())}")
            if self.moe_ffn_hidden_size is None:
                raise ValueError("num_moe_experts is set: set moe_ffn_hidden_size (HF moe_intermediate_size) too")
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                raise ValueError(f"moe_router_topk ({self.moe_router_topk}) must be in 1..num_moe_experts "
                                 f"({self.num_moe_experts})")
            if self.moe_router_score_function not in MOE_SCORE_FUNCTIONS:
                raise ValueError(f"moe_router_score_function: {self.moe_router_score_function!r} is not one of "
                                 f"{', '.join(MOE_SCORE_FUNCTIONS)}")
            if self.moe_layer_freq is not None:
                try:
                    self.moe_layer_freq = expand_layer_freq(self.moe_layer_freq, self.num_layers)
                except LayerFreqError as error:
                    raise ValueError(f"moe_layer_freq: {error}") from error
        if self.linear_attention_freq is not None:
            try:
                self.linear_attention_freq = expand_linear_attention_freq(self.linear_attention_freq, self.num_layers)
            except ValueError as error:
                raise ValueError(f"linear_attention_freq: {error}") from error
        problem = (mla_field_problem(self) or hybrid_field_problem(self) or dsa_field_problem(self)
                   or family(self.family).architecture_problem(self))
        if problem:
            raise ValueError(problem)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ModelArchitecture":
        """Load an architecture file; unknown keys are an error naming the file and key."""
        path = Path(path)
        with open(path) as handle:
            raw = yaml.safe_load(handle) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of architecture fields")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        try:
            return cls(**raw)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from error

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def moe_family_names() -> tuple[str, ...]:
    """The registered mixture-of-experts families."""
    return tuple(f.name for f in all_families() if f.moe)


def load_hf_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Read `<checkpoint_dir>/config.json`."""
    with open(Path(checkpoint_dir) / "config.json") as handle:
        return json.load(handle)

