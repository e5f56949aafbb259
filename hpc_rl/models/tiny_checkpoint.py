"""The tiny checkpoints' shared parts: the word-level tokenizer, the specs' common fields, and saving.

Owns: the tiny word-level vocabulary and its chat template, `TinyModelSpec` / `TinyMoeSpec` (the shapes every
family's tiny maker reads), the config fields they share, and saving a transformers model with the tokenizer
(`save_model`; MoE models made decisive first). Each family's own maker is `hpc_rl/models/<family>/tiny.py`
(its `make_tiny` hook); `hpc_rl.tiny_model` is the public import path and the CLI. Nothing is downloaded.
The vocabulary covers the synthetic task in `hpc_rl.data.tiny_task` (digits and a few words); any other word
maps to `<unk>`, so real datasets still load and run (as nonsense) on the tiny model. torch and transformers are
imported inside the functions (the registry's tier imports neither).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

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


def config_fields(spec: TinyModelSpec, tokenizer) -> dict:  # noqa: ANN001 - a transformers tokenizer
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


def randomize_moe(model, spec: TinyMoeSpec) -> None:  # noqa: ANN001 - a transformers model
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


def save_random_moe(model_class, config, spec: TinyMoeSpec, tokenizer, output_dir: Path):  # noqa: ANN001, ANN202
    """A transformers MoE model of `config`, seeded and made decisive (`_randomize_moe`), saved with the tokenizer."""
    import torch

    torch.manual_seed(spec.seed)
    model = model_class(config).to(torch.float32)
    randomize_moe(model, spec)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return model


def spec_of(spec_class: type, spec: Any, spec_fields: dict[str, Any]) -> Any:
    """`spec`, or a `spec_class` made of `spec_fields` (unknown fields: a TypeError naming them)."""
    if spec is not None:
        if spec_fields:
            raise TypeError(f"give a {spec_class.__name__} or its fields, not both")
        return spec
    unknown = sorted(set(spec_fields) - {f.name for f in fields(spec_class)})
    if unknown:
        raise TypeError(f"{spec_class.__name__} has no field(s) {', '.join(unknown)}")
    return spec_class(**spec_fields)


def save_dense(output_dir: str | Path, spec: TinyModelSpec, config_class: type, model_class: type,
               **extra: Any) -> Path:
    """A seeded random dense transformers model of `config_class` (shape from `spec`, plus `extra` config
    keys) saved with the tiny tokenizer in `output_dir`."""
    import torch

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = config_class(**config_fields(spec, tokenizer),
                          rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta}, **extra)
    torch.manual_seed(spec.seed)
    model = model_class(config).to(torch.float32)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def update_config_json(output_dir: Path, update: dict[str, Any], drop: tuple[str, ...] = ()) -> None:
    """Rewrite `output_dir/config.json` with keys set (`update`) and removed (`drop`)."""
    config_file = output_dir / "config.json"
    keys = json.loads(config_file.read_text())
    for key in drop:
        keys.pop(key, None)
    keys.update(update)
    config_file.write_text(json.dumps(keys, indent=2, sort_keys=True) + "\n")
