"""GLM-5's indexer head layout between HF and Megatron (the family's `to_megatron` / `to_hf` hooks); the names are
deepseek_v32's (hpc_rl.models.deepseek_v32.hf_names). Pure: torch only inside the hooks.

An indexer head of D dims holds r = qk_pos_emb_head_dim rotated dims. GLM-5 (transformers' GlmMoeDsaIndexer) puts
them first and rotates interleaved pairs (x_2i, x_2i+1) by frequency i; Megatron's DSAIndexer puts them last and
rotates the pairs (D-r+2i, D-r+2i+1) by frequency i. The scores are per-head dot products, so one permutation of the
D dims applied to wq_b (per head), wk and k_norm keeps them: Megatron dim m < D-r holds HF dim r+m, Megatron dim
D-r+j holds HF dim j (`megatron_order`). A pure permutation: converters round-trip bit-exact.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.models.deepseek_v32 import hf_names as dsa_names


def megatron_order(head_dim: int, rope_dim: int) -> list[int]:
    """For each Megatron indexer dim, the HF dim it holds (see the module docstring)."""
    return [rope_dim + m for m in range(head_dim - rope_dim)] + list(range(rope_dim))


def to_megatron(megatron_name: str, hf_tensors: list[Any], arch: Any) -> Any:
    return dsa_names.to_megatron(megatron_name, hf_tensors, arch, order_of=megatron_order)


def to_hf(megatron_name: str, full: Any, arch: Any) -> list[tuple[str, Any]] | None:
    return dsa_names.to_hf(megatron_name, full, arch, order_of=megatron_order)
