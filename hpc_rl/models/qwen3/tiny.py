"""The qwen3 family's tiny checkpoint (`make_tiny` hook): a random Qwen3ForCausalLM (~50k parameters by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_rl.models.tiny_checkpoint import TinyModelSpec, save_dense, spec_of


def make_tiny_model(output_dir: str | Path, spec: TinyModelSpec | None = None, **spec_fields: Any) -> Path:
    """Write a randomly initialised tiny Qwen3 checkpoint + tokenizer to `output_dir`; return it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return save_dense(output_dir, spec_of(TinyModelSpec, spec, spec_fields), Qwen3Config, Qwen3ForCausalLM)
