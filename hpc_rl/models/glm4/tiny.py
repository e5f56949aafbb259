"""The glm4 family's tiny checkpoint (`make_tiny` hook): a random Glm4ForCausalLM (sandwich norms, half rotary,
q/k/v bias, fused gate_up_proj) of the tiny shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_rl.models.tiny_checkpoint import TinyModelSpec, save_dense, spec_of


def make_tiny(output_dir: str | Path, spec: TinyModelSpec | None = None, **spec_fields: Any) -> Path:
    """Write a randomly initialised tiny GLM4 checkpoint + tokenizer to `output_dir`; return it."""
    from transformers import Glm4Config, Glm4ForCausalLM

    return save_dense(output_dir, spec_of(TinyModelSpec, spec, spec_fields), Glm4Config, Glm4ForCausalLM,
                      attention_bias=True)
