"""Tiny Qwen3 checkpoints with a locally built tokenizer, for tests, benchmarks and the CPU demo.

Owns: the tiny word-level vocabulary, its chat template, and writing an HF checkpoint directory
(config.json, model.safetensors, tokenizer files) with `save_pretrained`: dense Qwen3, the two
mixture-of-experts families (Qwen3-MoE, GLM-4.5 MoE) and the two multi-latent-attention ones (DeepSeek-V3,
GLM-4.7-Flash's Glm4MoeLite, with MTP layers in DeepSeek's on-disk layout), made by transformers' own model
classes with routers decisive enough that top-k choices are not near-ties. Nothing is downloaded.
The vocabulary covers the synthetic task in `hpc_rl.data.tiny_task` (digits and a few words); any
other word maps to `<unk>`, so real datasets still load and run (as nonsense) on the tiny model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "system", "copy", "add", "answer", "=", "+", ":"] + [str(d) for d in range(10)]
TINY_VOCAB = SPECIAL_TOKENS + WORDS

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@dataclass(kw_only=True)
class TinyModelSpec:
    """Shape of a tiny Qwen3 (defaults: ~50k parameters, 2 layers)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 512
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    seed: int = 0


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A word-level tokenizer over `TINY_VOCAB` with Qwen-style special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(TINY_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _config_fields(spec: TinyModelSpec, tokenizer) -> dict:  # noqa: ANN001 - a transformers tokenizer
    """The HF config fields every tiny family shares (shape, vocabulary, special tokens, float32)."""
    return dict(
        vocab_size=len(TINY_VOCAB), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), torch_dtype="float32",
    )


def make_tiny_model(output_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a randomly initialised tiny Qwen3 checkpoint + tokenizer to `output_dir`; return it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = spec or TinyModelSpec()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen3Config(**_config_fields(spec, tokenizer),
                         rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


@dataclass(kw_only=True)
class TinyMoeSpec(TinyModelSpec):
    """Shape of a tiny MoE model (defaults: Qwen3-MoE, 2 layers, 4 experts of which each token uses 2)."""

    family: str = "qwen3_moe"
    """qwen3_moe (Qwen3MoeForCausalLM) | glm4_moe (Glm4MoeForCausalLM)."""
    tie_word_embeddings: bool = False
    """Untied, as the real checkpoints: SGLang 0.5.23's Qwen3-MoE always builds its own lm_head (a tied
    checkpoint, which has no lm_head.weight, serves uniform log-probs there)."""
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    dense_layers: int = 0
    """Leading dense layers (Qwen3-MoE's mlp_only_layers 0..k-1, GLM-4.5's first_k_dense_replace)."""
    n_shared_experts: int = 1
    """GLM-4.5 only (Qwen3-MoE has none)."""
    routed_scaling_factor: float = 1.0
    """GLM-4.5 only."""
    router_std: float = 1.0
    """Router weights ~ N(0, router_std): well-separated top-k choices (transformers initialises them
    near zero, where float rounding could pick a different expert in another implementation)."""


def _randomize_moe(model, spec: TinyMoeSpec) -> None:  # noqa: ANN001 - a transformers model
    """Make every MoE-specific tensor matter: decisive routers, non-zero expert biases, norms and biases."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * spec.router_std)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
            elif name.endswith(("norm.weight", "proj.bias")):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)


def _save_random_moe(model_class, config, spec: TinyMoeSpec, tokenizer, output_dir: Path):  # noqa: ANN001, ANN202
    """A transformers MoE model of `config`, seeded and made decisive (`_randomize_moe`), saved with the tokenizer."""
    import torch

    torch.manual_seed(spec.seed)
    model = model_class(config).to(torch.float32)
    _randomize_moe(model, spec)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return model


def make_tiny_moe_model(output_dir: str | Path, spec: TinyMoeSpec | None = None) -> Path:
    """Write a randomly initialised tiny MoE checkpoint (spec.family) + the tiny tokenizer; return it."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    spec = spec or TinyMoeSpec()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    common = dict(_config_fields(spec, tokenizer), moe_intermediate_size=spec.moe_intermediate_size,
                  num_experts_per_tok=spec.num_experts_per_tok, norm_topk_prob=True)
    if spec.family == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_experts=spec.num_experts, mlp_only_layers=list(range(spec.dense_layers)),
                                decoder_sparse_step=1,
                                rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
        model_class = Qwen3MoeForCausalLM
    elif spec.family == "glm4_moe":
        config = Glm4MoeConfig(**common, n_routed_experts=spec.num_experts, n_shared_experts=spec.n_shared_experts,
                               first_k_dense_replace=spec.dense_layers,
                               routed_scaling_factor=spec.routed_scaling_factor,
                               n_group=1, topk_group=1, attention_bias=True, use_qk_norm=False,
                               partial_rotary_factor=0.5,
                               rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                                                "partial_rotary_factor": 0.5})
        model_class = Glm4MoeForCausalLM
    else:
        raise ValueError(f"TinyMoeSpec.family {spec.family!r}: use qwen3_moe or glm4_moe")
    model = _save_random_moe(model_class, config, spec, tokenizer, output_dir)
    if spec.family == "qwen3_moe":  # the Hub's key (Qwen3-30B-A3B), which transformers 4.x readers (SGLang) know
        config_file = output_dir / "config.json"
        fields = json.loads(config_file.read_text())
        fields["num_experts"] = fields.pop("num_local_experts", spec.num_experts)
        config_file.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return output_dir


@dataclass(kw_only=True)
class TinyMlaSpec(TinyMoeSpec):
    """Shape of a tiny multi-latent-attention MoE model (DeepSeek-V3 family by default; GLM-4.7-Flash's
    Glm4MoeLite with family glm4_moe_lite): 2 layers (the first dense), 4 experts in 2 groups, one MTP layer."""

    family: str = "deepseek_v3"
    """deepseek_v3 (DeepseekV3ForCausalLM) | glm4_moe_lite (Glm4MoeLiteForCausalLM)."""
    num_key_value_heads: int = 4
    q_lora_rank: int | None = 32
    """None: one full q projection (Moonlight)."""
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    dense_layers: int = 1
    n_group: int = 2
    """Expert groups; top-k 2 of 1 group keeps DeepSeek's top-2 group score equal to Megatron's (topk / group_topk)."""
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    tie_word_embeddings: bool = False
    rope_theta: float = 10_000.0
    yarn: dict | None = None
    """YaRN keys of rope_parameters (factor, original_max_position_embeddings, mscale, mscale_all_dim,
    beta_fast, beta_slow); None: plain RoPE."""
    mtp_layers: int = 1
    """MTP layers written after the decoder (model.layers.<L + k>.*, DeepSeek's on-disk layout)."""


def _mtp_tensors(model, spec: TinyMlaSpec, num_layers: int) -> dict:  # noqa: ANN001 - a transformers model
    """Random MTP layers shaped like the model's last (MoE) layer, under the checkpoint's on-disk names
    (per-expert gate/up/down, enorm, hnorm, eh_proj, shared_head.norm, and DeepSeek's embedding/head copies)."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed + 2)
    saved = {}
    for name, tensor in model.state_dict().items():
        prefix = f"model.layers.{num_layers - 1}."
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest.endswith("mlp.experts.gate_up_proj"):
            inner = tensor.shape[1] // 2
            for expert in range(tensor.shape[0]):
                saved[f"mlp.experts.{expert}.gate_proj.weight"] = tensor.new_empty(tensor[expert, :inner].shape)
                saved[f"mlp.experts.{expert}.up_proj.weight"] = tensor.new_empty(tensor[expert, inner:].shape)
        elif rest.endswith("mlp.experts.down_proj"):
            for expert in range(tensor.shape[0]):
                saved[f"mlp.experts.{expert}.down_proj.weight"] = tensor.new_empty(tensor[expert].shape)
        else:
            saved[rest] = tensor.new_empty(tensor.shape)
    hidden = spec.hidden_size
    saved.update({"enorm.weight": torch.empty(hidden), "hnorm.weight": torch.empty(hidden),
                  "eh_proj.weight": torch.empty(hidden, 2 * hidden), "shared_head.norm.weight": torch.empty(hidden)})
    out = {}
    for depth in range(spec.mtp_layers):
        for rest, template in saved.items():
            if rest.endswith("norm.weight"):
                value = 1.0 + 0.1 * torch.randn(template.shape, generator=generator)
            elif rest.endswith("mlp.gate.weight"):
                value = torch.randn(template.shape, generator=generator) * spec.router_std
            elif rest.endswith("e_score_correction_bias"):
                value = torch.randn(template.shape, generator=generator) * 0.1
            else:
                value = torch.randn(template.shape, generator=generator) * 0.02
            out[f"model.layers.{num_layers + depth}.{rest}"] = value.to(torch.float32).contiguous()
        out[f"model.layers.{num_layers + depth}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        out[f"model.layers.{num_layers + depth}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def make_tiny_mla_model(output_dir: str | Path, spec: TinyMlaSpec | None = None) -> Path:
    """Write a randomly initialised tiny MLA MoE checkpoint (spec.family) with its MTP layers + the tiny tokenizer."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    spec = spec or TinyMlaSpec()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.yarn:
        rope = {"rope_type": "yarn", "rope_theta": spec.rope_theta, **spec.yarn}
    common = dict(
        vocab_size=len(TINY_VOCAB), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        n_shared_experts=spec.n_shared_experts, n_routed_experts=spec.num_experts,
        routed_scaling_factor=spec.routed_scaling_factor, kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, qk_nope_head_dim=spec.qk_nope_head_dim,
        n_group=spec.n_group, topk_group=spec.topk_group, num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True, max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings, rope_parameters=rope, rope_interleave=True, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), torch_dtype="float32",
    )
    if spec.family == "deepseek_v3":
        config = DeepseekV3Config(**common, first_k_dense_replace=spec.dense_layers, num_mtp_layers=spec.mtp_layers)
        model_class = DeepseekV3ForCausalLM
    elif spec.family == "glm4_moe_lite":
        config = Glm4MoeLiteConfig(**common, mlp_layer_types=["dense"] * spec.dense_layers
                                   + ["sparse"] * (spec.num_hidden_layers - spec.dense_layers))
        model_class = Glm4MoeLiteForCausalLM
    else:
        raise ValueError(f"TinyMlaSpec.family {spec.family!r}: use deepseek_v3 or glm4_moe_lite")
    model = _save_random_moe(model_class, config, spec, tokenizer, output_dir)
    if spec.mtp_layers:
        weights_file = output_dir / "model.safetensors"
        weights = load_file(str(weights_file))
        weights.update(_mtp_tensors(model, spec, spec.num_hidden_layers))
        save_file(weights, str(weights_file), metadata={"format": "pt"})
        weights_file.chmod(0o644)
    config_file = output_dir / "config.json"
    fields = json.loads(config_file.read_text())
    fields["num_nextn_predict_layers"] = spec.mtp_layers  # GLM-4.7-Flash's key too (Glm4MoeLiteConfig has no MTP field)
    # keys of the published DeepSeek-V3 / GLM-4.7-Flash config.json that transformers 5 drops and SGLang reads
    fields.update({"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    config_file.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="directory to write the HF checkpoint into")
    parser.add_argument("--hidden-size", type=int, default=TinyModelSpec.hidden_size)
    parser.add_argument("--num-layers", type=int, default=TinyModelSpec.num_hidden_layers)
    parser.add_argument("--seed", type=int, default=TinyModelSpec.seed)
    parser.add_argument("--family", default="qwen3",
                        choices=["qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "glm4_moe_lite"],
                        help="qwen3 (dense, assets/tiny_qwen3), a mixture of experts (assets/tiny_qwen3_moe: "
                             "--family qwen3_moe) or multi-latent attention with MTP (assets/tiny_deepseek_v3: "
                             "--family deepseek_v3)")
    args = parser.parse_args(argv)
    if args.family == "qwen3":
        spec = TinyModelSpec(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers, seed=args.seed,
                             intermediate_size=2 * args.hidden_size)
        print(make_tiny_model(args.output_dir, spec))
    elif args.family in ("deepseek_v3", "glm4_moe_lite"):
        mla = TinyMlaSpec(family=args.family, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                          seed=args.seed, intermediate_size=2 * args.hidden_size)
        print(make_tiny_mla_model(args.output_dir, mla))
    else:
        moe = TinyMoeSpec(family=args.family, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                          seed=args.seed, intermediate_size=2 * args.hidden_size)
        print(make_tiny_moe_model(args.output_dir, moe))


if __name__ == "__main__":
    main()
