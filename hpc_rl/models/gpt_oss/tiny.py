"""A tiny random gpt-oss checkpoint written by transformers' GptOssForCausalLM, for tests and the CPU demo.

Owns: its shape (2 layers, the first sliding-window and the second full attention, 4 experts of which each token
uses 2, YaRN as gpt-oss-20b's config.json has it) and making every gpt-oss-specific tensor matter: sinks, router
weights and bias, expert biases are drawn large enough to change the logits, and swiglu_limit is small enough
that the clamps cut (a test that ignored the clamp or a sink would fail). Saved with `save_pretrained`, so the
experts are on disk as transformers and SGLang read them: fused `mlp.experts.gate_up_proj` [E, H, 2I] with gate
and up interleaved, `gate_up_proj_bias`, `down_proj` [E, I, H], `down_proj_bias`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rl.models.tiny_checkpoint import TinyModelSpec, build_tokenizer, config_fields, spec_of


@dataclass(kw_only=True)
class TinyGptOssSpec(TinyModelSpec):
    """Shape of a tiny gpt-oss (hidden 64, experts of width 48 so that no transposition can pass unnoticed)."""

    intermediate_size: int = 48
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    sliding_window: int = 4
    """Short enough that the test's sequences run past it."""
    swiglu_limit: float = 1.0
    """gpt-oss-20b's is 7.0; 1.0 makes the tiny model's clamps cut."""
    tie_word_embeddings: bool = False
    rope_theta: float = 150000.0
    max_position_embeddings: int = 131072
    """YaRN's factor x its original context, as gpt-oss-20b's config.json (transformers warns otherwise)."""
    yarn_factor: float = 32.0
    original_max_position_embeddings: int = 4096


def make_tiny(output_dir: str | Path, spec: TinyGptOssSpec | None = None, **spec_fields: Any) -> Path:
    """Write the tiny gpt-oss checkpoint and the tiny tokenizer to `output_dir`; return it (the `make_tiny` hook)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    spec = spec_of(TinyGptOssSpec, spec, spec_fields)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    layer_types = ["sliding_attention" if layer % 2 == 0 else "full_attention"
                   for layer in range(spec.num_hidden_layers)]
    config = GptOssConfig(
        **config_fields(spec, tokenizer), num_local_experts=spec.num_local_experts,
        num_experts_per_tok=spec.num_experts_per_tok, sliding_window=spec.sliding_window, layer_types=layer_types,
        swiglu_limit=spec.swiglu_limit, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": spec.rope_theta, "factor": spec.yarn_factor,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": spec.original_max_position_embeddings})
    config._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = GptOssForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    scales = {"self_attn.sinks": 1.0, "mlp.router.weight": 1.0, "mlp.router.bias": 0.5,
              "mlp.experts.gate_up_proj": 0.3, "mlp.experts.gate_up_proj_bias": 0.3, "mlp.experts.down_proj": 0.2,
              "mlp.experts.down_proj_bias": 0.1, "proj.bias": 0.1, "norm.weight": 0.1}
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            for suffix, scale in scales.items():
                if name.endswith(suffix):
                    noise = torch.randn(tensor.shape, generator=generator) * scale
                    if suffix == "norm.weight":
                        tensor.add_(noise)
                    else:
                        tensor.copy_(noise)
                    break
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
