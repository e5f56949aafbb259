"""HF <-> Megatron names and layouts of a DeepSeek Sparse Attention layer (deepseek_v32 family).

Owns: the family's `hf_layer_rows` hook (deepseek_v3's MLA rows, the indexer's, then the MLP's) and its
`to_megatron` / `to_hf` hooks for the indexer's head layout (pure module: torch only inside the hooks).

  Megatron (DSAttention's indexer)                          HF (DeepseekV32 checkpoints, SGLang)
  self_attention.core_attention.indexer.linear_wq_b.weight  self_attn.indexer.wq_b.weight   [heads*D, q_lora_rank]
  self_attention.core_attention.indexer.linear_wk.weight    self_attn.indexer.wk.weight     [D, hidden]
  self_attention.core_attention.indexer.k_norm.weight/bias  self_attn.indexer.k_norm.weight/bias  (LayerNorm, D)
  self_attention.core_attention.indexer.linear_weights_proj.weight  self_attn.indexer.weights_proj.weight
                                                            [heads, hidden]

All are replicated over TP (Megatron builds them "duplicated"). Layout: an indexer head of D dims holds r =
qk_pos_emb_head_dim rotated dims. HF (and DeepSeek's reference) put them first, rotated half-split
([x_0..x_{r/2-1}] with [x_{r/2}..x_{r-1}]); Megatron's DSAIndexer puts them last, and its MLA rotary
de-interleaves them (pairs (x_2i, x_2i+1)). The scores are dot products q.k per head, so one permutation of the D
dims applied to wq_b (per head), wk and k_norm (the LayerNorm is applied per dim) gives the same scores: Megatron dim
D-r+2i holds HF dim i, D-r+2i+1 holds HF dim r/2+i, dim m < D-r holds HF dim r+m (`megatron_order`). A pure
permutation, so converters round-trip bit-exact.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.models.deepseek_v3.hf_names import mla_attention_rows
from hpc_rl.models.name_rows import mlp_rows
from hpc_rl.models.registry import NameRow

INDEXER = "self_attention.core_attention.indexer."
INDEXER_ROWS = (("linear_wq_b.weight", "wq_b.weight"), ("linear_wk.weight", "wk.weight"),
                ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
                ("linear_weights_proj.weight", "weights_proj.weight"))
"""(Megatron suffix under INDEXER, HF suffix under self_attn.indexer.)."""
PERMUTED = ("linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias")


def layer_rows(arch: Any, layer: int) -> list[NameRow]:
    """Decoder layer `layer`: MLA attention, its indexer, then the MLP (dense or MoE)."""
    indexer = [(INDEXER + ours, [f"self_attn.indexer.{theirs}"]) for ours, theirs in INDEXER_ROWS]
    return mla_attention_rows(arch) + indexer + mlp_rows(arch, layer)


def megatron_order(head_dim: int, rope_dim: int) -> list[int]:
    """For each Megatron indexer dim, the HF dim it holds (see the module docstring)."""
    nope = head_dim - rope_dim
    order = [rope_dim + m for m in range(nope)]
    for i in range(rope_dim // 2):
        order += [i, rope_dim // 2 + i]
    return order


def _permuted(megatron_name: str) -> bool:
    return megatron_name.startswith("decoder.layers.") and INDEXER in megatron_name and \
        megatron_name.endswith(PERMUTED)


def _rows_permutation(megatron_name: str, arch: Any, inverse: bool, order_of: Any = megatron_order) -> Any:
    import torch

    order = torch.tensor(order_of(arch.dsa_indexer_head_dim, arch.qk_pos_emb_head_dim))
    if inverse:
        order = torch.argsort(order)
    if megatron_name.endswith("linear_wq_b.weight"):  # per head
        heads = arch.dsa_indexer_n_heads
        order = (torch.arange(heads)[:, None] * arch.dsa_indexer_head_dim + order[None, :]).reshape(-1)
    return order


def to_megatron(megatron_name: str, hf_tensors: list[Any], arch: Any, order_of: Any = megatron_order) -> Any:
    """The indexer's q/k rows (and k_norm) in Megatron's head layout; None for every other tensor. `order_of`:
    (head_dim, rope_dim) -> the HF dim each Megatron dim holds (GLM-5's indexer rotates interleaved pairs)."""
    if not _permuted(megatron_name):
        return None
    (tensor,) = hf_tensors
    return tensor[_rows_permutation(megatron_name, arch, False, order_of)].contiguous()


def to_hf(megatron_name: str, full: Any, arch: Any, order_of: Any = megatron_order) -> list[tuple[str, Any]] | None:
    """Inverse of `to_megatron`: (HF name, tensor) for the indexer's permuted tensors; None for the rest."""
    if not _permuted(megatron_name):
        return None
    layer, suffix = megatron_name[len("decoder.layers."):].split("." + INDEXER, 1)
    name = f"model.layers.{layer}.self_attn.indexer.{dict(INDEXER_ROWS)[suffix]}"
    return [(name, full[_rows_permutation(megatron_name, arch, True, order_of)].contiguous())]
