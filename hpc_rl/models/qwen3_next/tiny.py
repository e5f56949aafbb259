"""Tiny random Qwen3-Next / Qwen3.5 / Qwen3.5-MoE checkpoints, written by transformers' own classes.

Owns: `make_tiny(output_dir, family=...)`: a 4-layer hybrid (layers 0-2 Gated DeltaNet, layer 3 full attention with
its output gate, transformers' `full_attention_interval` 4), hidden 64, GQA 4/2 heads of 16 with a quarter rotated,
linear attention with 2 key heads and 4 value heads of 16 (grouped: each key head serves two value heads), a 4-wide
convolution; the MoE ones 4 experts of 32, top-2, a gated shared expert of 32. Every tensor is random and matters:
zero-centred norms get small random weights (1 + w), routers are decisive (no near-ties between implementations),
A_log and dt_bias spread. qwen3_5 and qwen3_5_moe are the text models (Qwen3_5ForCausalLM, model_type
qwen3_5_text); with `vlm=True` the vision-language classes, as released (the text tower under
`model.language_model.`, a one-block vision tower). The tokenizer is hpc_rl.tiny_model's. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def tiny_config_fields(family: str, **overrides: Any) -> dict[str, Any]:
    """The transformers config keyword arguments of a tiny `family` checkpoint (overrides win)."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny hybrid family {family!r}: use one of {', '.join(TINY_FAMILIES)}")
    fields: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
    )
    if family != "qwen3_5":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32)
    if family == "qwen3_next":
        fields.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    fields.update(overrides)
    return fields


def _randomize(model: Any, seed: int) -> None:
    """Make every tensor matter: zero-centred norms and the gated norm off their initial values, decisive
    routers, spread decays (A_log) and time-step biases (dt_bias)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            elif name.endswith("norm.weight"):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
            elif name.endswith(("A_log", "dt_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
            elif name.endswith("conv1d.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)


TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                   num_position_embeddings=16)
"""The vision tower of a tiny vision-language checkpoint (`vlm=True`): one block; its output is the text's hidden."""


def _vlm_model(family: str, fields: dict[str, Any], vocab: int) -> Any:
    """transformers' vision-language class of `family` over the text `fields`, with a tiny vision tower (the
    image/video tokens are the tokenizer's last four ids)."""
    if family == "qwen3_5":
        from transformers import Qwen3_5Config as Config, Qwen3_5ForConditionalGeneration as Model
    elif family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig as Config, Qwen3_5MoeForConditionalGeneration as Model
    else:
        raise ValueError(f"vlm=True: {family} has no vision-language release; use qwen3_5 or qwen3_5_moe")
    vision = {**TINY_VISION, "out_hidden_size": fields["hidden_size"]}
    config = Config(text_config=fields, vision_config=vision, image_token_id=vocab - 4, video_token_id=vocab - 3,
                    vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1,
                    tie_word_embeddings=fields["tie_word_embeddings"])
    return Model(config)


def make_tiny(output_dir: str | Path, family: str = "qwen3_next", seed: int = 0, vlm: bool = False,
              **overrides: Any) -> Path:
    """Write a randomly initialised tiny `family` checkpoint (config.json, model.safetensors, the tiny tokenizer).
    With fewer than 4 layers the last one is the full-attention layer (every kind of layer is in the model).
    `vlm`: the vision-language layout of Qwen3.5's releases (the text tower under `model.language_model.`, a tiny
    vision tower under `model.visual.`, config.json's text keys under text_config)."""
    import torch

    from hpc_rl.models.tiny_checkpoint import build_tokenizer

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    special = dict(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(
        "<|im_end|>"), pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    fields = {**tiny_config_fields(family, **overrides), **special}
    fields["full_attention_interval"] = min(4, fields["num_hidden_layers"])
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig as Config, Qwen3NextForCausalLM as Model
    elif family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM as Model, Qwen3_5TextConfig as Config
    else:
        from transformers import Qwen3_5MoeForCausalLM as Model, Qwen3_5MoeTextConfig as Config
    torch.manual_seed(seed)
    model = (_vlm_model(family, fields, len(tokenizer)) if vlm else Model(Config(**fields))).to(torch.float32)
    _randomize(model, seed)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    config_file = output_dir / "config.json"
    saved = json.loads(config_file.read_text())
    saved["torch_dtype"] = "float32"
    if not vlm:  # as released: SGLang 0.5.23's Qwen3NextConfig reads it (transformers 5.24 writes layer_types only)
        saved["full_attention_interval"] = fields["full_attention_interval"]
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return output_dir


def make_tiny_qwen3_next(output_dir: str | Path, **fields: Any) -> Path:
    """The qwen3_next family's `make_tiny` hook."""
    return make_tiny(output_dir, family="qwen3_next", **fields)


def make_tiny_qwen3_5(output_dir: str | Path, **fields: Any) -> Path:
    """The qwen3_5 family's `make_tiny` hook."""
    return make_tiny(output_dir, family="qwen3_5", **fields)


def make_tiny_qwen3_5_moe(output_dir: str | Path, **fields: Any) -> Path:
    """The qwen3_5_moe family's `make_tiny` hook."""
    return make_tiny(output_dir, family="qwen3_5_moe", **fields)
