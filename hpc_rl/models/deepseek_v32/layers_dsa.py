"""CPU twins of the GPU-only pieces of Megatron's DeepSeek Sparse Attention (megatron-core 0.16.1,
`megatron/core/transformer/experimental_attention_variant/dsa.py`), and packed samples over it.

Owns: `hadamard_rotation` (the twin of `rotate_activation`, installed by `install_cpu_twins` only when CUDA is
absent), `IndexerLinear` and `IndexerKeyNorm` (the indexer's "duplicated" linears and its LayerNorm without
Transformer Engine: Megatron's local backend has no `linear()`, and its torch LayerNorm refuses sequence
parallelism), and `PackedDSAttention` (DSAttention over THD-packed samples).

What on the GPU path cannot run here (and why each twin exists):
* `rotate_activation` calls `fast_hadamard_transform.hadamard_transform` (a CUDA extension) and asserts bf16
  input. Its contract: x @ H_d * d^-0.5 over the last dim (H_d the Sylvester Hadamard matrix, d a power of two),
  an orthogonal map applied to both q and k, so q.k is unchanged in exact arithmetic. The twin computes exactly
  that in fp32 for any dtype, returning the input's dtype.
* Everything else in dsa.py is plain torch (einsum, topk, scatter, softmax) and runs as is: the indexer's
  scores (`_compute_index_scores`), its top-k, `unfused_dsa_fn`, the KL indexer loss.
* Megatron refuses packed sequences (`assert packed_seq_params is None` in DSAIndexer.forward_with_scores);
  `PackedDSAttention` runs Megatron's own DSAttention.forward on each `cu_seqlens` span (positions restart at 0
  in each sample, as in the unpacked call) and concatenates. Under sequence parallelism the spans would have to
  be cut from the gathered sequence: refused with the reason.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant import dsa
from megatron.core.transformer.transformer_config import TransformerConfig

_installed = False


@functools.lru_cache(maxsize=8)
def _hadamard(dim: int) -> torch.Tensor:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"Hadamard rotation of width {dim}: the width must be a power of two "
                         f"(the indexer's index_head_dim)")
    matrix = torch.ones(1, 1)
    while matrix.size(0) < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


def hadamard_rotation(x: torch.Tensor) -> torch.Tensor:
    """`rotate_activation`'s contract on any device and dtype: x @ H_d * d^-0.5 over the last dim, in fp32."""
    dim = x.size(-1)
    matrix = _hadamard(dim).to(x.device)
    return (x.float() @ matrix * dim ** -0.5).to(x.dtype)


def install_cpu_twins() -> bool:
    """On a CPU-only build, make Megatron's DSA use `hadamard_rotation`; idempotent. True if installed."""
    global _installed
    if torch.cuda.is_available():
        return False
    if not _installed:
        dsa.rotate_activation = hadamard_rotation
        _installed = True
    return True


class IndexerLinear(torch.nn.Module):
    """y = x W^T with the whole W on every TP rank: what TE's `TELinear(parallel_mode="duplicated")` computes for
    the indexer; takes the arguments DSAIndexer builds it with and returns (output, None)."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, init_method: Any,
                 bias: bool, skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 parallel_mode: str = "duplicated", **_: Any) -> None:
        super().__init__()
        if bias or parallel_mode != "duplicated" or skip_weight_param_allocation:
            raise ValueError(f"IndexerLinear: the indexer's linears are bias-free and duplicated over TP "
                             f"(bias={bias}, parallel_mode={parallel_mode!r})")
        device = "cpu" if not torch.cuda.is_available() else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype,
                                                     device=device))
        init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class IndexerKeyNorm(torch.nn.LayerNorm):
    """The indexer's key LayerNorm (weight and bias, `config.layernorm_epsilon`), built as Megatron's norms are.
    It normalises the sequence the indexer has already gathered, so sequence parallelism does not apply."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        device = "cpu" if not torch.cuda.is_available() else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)


class PackedDSAttention(dsa.DSAttention):
    """Megatron's DSAttention; with THD `packed_seq_params`, its own forward once per packed sample."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                x: torch.Tensor, qr: torch.Tensor, attn_mask_type: AttnMaskType | None = None,
                attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, x, qr, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if self.config.sequence_parallel and self.indexer.pg_collection.tp.size() > 1:
            raise NotImplementedError("DeepSeek Sparse Attention over packed samples with sequence parallelism: "
                                      "the indexer gathers the sequence itself, so samples cannot be cut before "
                                      "it; not built (use TP 1, or unpacked bshd micro-batches)")
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        bounds = cu_seqlens.tolist()
        if qr.dim() == 2:  # MLA squeezes the latents of a THD batch to [t, q_lora_rank]
            qr = qr.unsqueeze(1)
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            span = slice(start, end)
            out = super().forward(query[span].unsqueeze(1), key[span].unsqueeze(1), value[span].unsqueeze(1),
                                  None, x[span], qr[span], attn_mask_type=AttnMaskType.causal)
            outputs.append(out)
        total = query.size(0)
        if bounds[-1] < total:  # trailing tokens past the last sample attend to nothing: zeros
            outputs.append(query.new_zeros(total - bounds[-1], 1, outputs[0].size(-1)))
        return torch.cat(outputs, dim=0)
