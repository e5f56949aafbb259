"""Tiny random checkpoints with a locally built tokenizer, for tests, benchmarks and the CPU demo: the public
import path and the CLI (`python -m hpc_rl.tiny_model OUT --family qwen3_moe`, tools/make_tiny_model.py).

Owns: only the command line and the names tests, tools and benchmarks import. The makers are each family's
`make_tiny` hook (`hpc_rl/models/<family>/tiny.py`, found through `hpc_rl.models`); the tokenizer and the
shared specs are `hpc_rl.models.tiny_checkpoint`. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc_rl.models.deepseek_v3.tiny import TinyMlaSpec, make_tiny_mla_model
from hpc_rl.models.qwen3.tiny import make_tiny_model
from hpc_rl.models.registry import all_families, family
from hpc_rl.models.tiny_checkpoint import (
    CHAT_TEMPLATE, SPECIAL_TOKENS, TINY_VOCAB, WORDS, TinyModelSpec, TinyMoeSpec, build_tokenizer,
)

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TINY_VOCAB", "WORDS", "TinyMlaSpec", "TinyModelSpec", "TinyMoeSpec",
           "build_tokenizer", "main", "make_tiny_mla_model", "make_tiny_model", "make_tiny_moe_model"]


def make_tiny_moe_model(output_dir: str | Path, spec: TinyMoeSpec | None = None) -> Path:
    """Write a randomly initialised tiny MoE checkpoint (spec.family: a GQA MoE family) + the tiny tokenizer."""
    spec = spec or TinyMoeSpec()
    choices = [f.name for f in all_families() if f.moe and not f.mla and f.make_tiny is not None]
    if spec.family not in choices:
        raise ValueError(f"TinyMoeSpec.family {spec.family!r}: use {' or '.join(sorted(choices, reverse=True))}")
    maker = family(spec.family).make_tiny
    assert maker is not None
    return maker(output_dir, spec)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="directory to write the HF checkpoint into")
    parser.add_argument("--hidden-size", type=int, default=TinyModelSpec.hidden_size)
    parser.add_argument("--num-layers", type=int, default=TinyModelSpec.num_hidden_layers)
    parser.add_argument("--seed", type=int, default=TinyModelSpec.seed)
    parser.add_argument("--family", default="qwen3",
                        choices=[f.name for f in all_families() if f.make_tiny is not None],
                        help="qwen3 (dense, assets/tiny_qwen3), a mixture of experts (assets/tiny_qwen3_moe: "
                             "--family qwen3_moe) or multi-latent attention with MTP (assets/tiny_deepseek_v3: "
                             "--family deepseek_v3); any registered family with a tiny maker")
    args = parser.parse_args(argv)
    maker = family(args.family).make_tiny
    assert maker is not None
    print(maker(args.output_dir, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers, seed=args.seed,
                intermediate_size=2 * args.hidden_size))


if __name__ == "__main__":
    main()
