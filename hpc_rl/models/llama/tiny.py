"""The llama family's tiny checkpoint (`make_tiny` hook): a random LlamaForCausalLM of the tiny shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_rl.models.tiny_checkpoint import TinyModelSpec, save_dense, spec_of


def make_tiny(output_dir: str | Path, spec: TinyModelSpec | None = None, **spec_fields: Any) -> Path:
    """Write a randomly initialised tiny Llama checkpoint + tokenizer to `output_dir`; return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_dense(output_dir, spec_of(TinyModelSpec, spec, spec_fields), LlamaConfig, LlamaForCausalLM)
