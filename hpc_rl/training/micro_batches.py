"""Micro-batches as the model consumes them: right-padded `[b, s]` ("bshd") or packed `[1, T]` ("thd").

Owns: turning some samples' token ids into model inputs (tokens, position ids, attention mask,
Megatron `PackedSeqParams`), running the model on them, and reading each sample's response
log-probs / entropies back out of the (vocab-parallel) logits. Which samples form a micro-batch is
`batching`'s business; the loss is `losses`'.

Packed ("thd", the default, as in slime): the samples are concatenated into one row with
`cu_seqlens` marking where each starts; positions restart at 0 per sample and attention never
crosses a boundary (Transformer Engine's THD kernels on GPU; `layer_specs.PackedSequenceAttention`
on CPU). When the packed length must be a multiple of TP (sequence parallel), the tail padding is
one extra dummy sequence, so no real sample ever attends to it. No padding is wasted inside the
row, which is what makes token-budget micro-batches (`max_tokens_per_gpu`) cheap.

Padded ("bshd"): one row per sample, right-padded with token 0 and a causal mask; padding sits
after every real token, so it never changes a real token's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpc_rl.training.logprobs import vocab_parallel_logprobs
from hpc_rl.training.model_provider import causal_mask

QKV_FORMATS = ("thd", "bshd")


@dataclass
class MicroBatch:
    """Some samples of a rollout in the layout the model consumes."""

    indices: list[int]
    """Positions of these samples in the rollout's `TrainBatch`."""
    total_lengths: list[int]
    response_lengths: list[int]
    tokens: torch.Tensor
    """[b, s] right-padded, or [1, T] packed."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    packed_seq_params: object | None
    """Megatron `PackedSeqParams` (thd) or None (bshd)."""
    starts: list[int]
    """Where each sample starts in the packed row (all 0 when padded: one row each)."""

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        """Vocab-parallel logits, [b, s, V_local] or [1, T, V_local]."""
        return model(self.tokens, self.position_ids, self.attention_mask, packed_seq_params=self.packed_seq_params)

    def response_logprobs(self, logits: torch.Tensor, *, vocab_size: int, tp_group: dist.ProcessGroup | None = None,
                          with_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sample log-probs (and entropies) of the response tokens, from `forward`'s logits.

        Shifted position t scores token t + 1, so a sample starting at `o` with length L and r
        response tokens is scored at positions [o + L - r - 1, o + L - 1).
        """
        log_probs, entropy = vocab_parallel_logprobs(logits[:, :-1], self.tokens[:, 1:], vocab_size=vocab_size,
                                                     tp_group=tp_group, with_entropy=with_entropy)
        rows = [0] * len(self.indices) if self.packed else list(range(len(self.indices)))
        slices = [slice(o + length - r - 1, o + length - 1)
                  for o, length, r in zip(self.starts, self.total_lengths, self.response_lengths)]
        per_sample = [log_probs[row, where] for row, where in zip(rows, slices)]
        per_entropy = None if entropy is None else [entropy[row, where] for row, where in zip(rows, slices)]
        return per_sample, per_entropy


def build_microbatch(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], indices: Sequence[int], *,
                     qkv_format: str = "thd", pad_multiple: int = 1,
                     device: torch.device | str = "cpu") -> MicroBatch:
    """The model inputs for these samples; the sequence dim is a multiple of `pad_multiple` (TP with SP)."""
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"training.qkv_format: {qkv_format!r} is not one of {', '.join(QKV_FORMATS)}")
    lengths = [len(t) for t in tokens]
    if qkv_format == "bshd":
        width = max(lengths)
        width += (-width) % pad_multiple
        ids = torch.zeros((len(tokens), width), dtype=torch.long)
        for row, toks in enumerate(tokens):
            ids[row, : len(toks)] = torch.as_tensor(toks, dtype=torch.long)
        ids = ids.to(device)
        positions = torch.arange(width, device=device).unsqueeze(0).expand(len(tokens), -1)
        return MicroBatch(indices=list(indices), total_lengths=lengths, response_lengths=list(response_lengths),
                          tokens=ids, position_ids=positions, attention_mask=causal_mask(width, device),
                          packed_seq_params=None, starts=[0] * len(tokens))
    from megatron.core.packed_seq_params import PackedSeqParams

    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    total = starts[-1]
    pad = (-total) % pad_multiple
    bounds = starts + ([total + pad] if pad else [])
    ids = torch.zeros(total + pad, dtype=torch.long)
    ids[:total] = torch.as_tensor([t for toks in tokens for t in toks], dtype=torch.long)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return MicroBatch(indices=list(indices), total_lengths=lengths, response_lengths=list(response_lengths),
                      tokens=ids.unsqueeze(0).to(device), position_ids=positions.unsqueeze(0).to(device),
                      attention_mask=None, packed_seq_params=params, starts=starts[:-1])
