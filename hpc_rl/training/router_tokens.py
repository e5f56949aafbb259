"""Which sample and position each token a MoE router sees on this rank is (pure, over a `MicroBatch`).

Owns `router_tokens(micro, sp_size, sp_rank)`: for every token of the micro-batch in the order a
Megatron router reads them on this rank, its sample (slot in `micro.indices`) and its position in
that sample's token ids, or -1 for padding. Routing replay lays the engines' routed experts out in
that order, and router statistics leave padding out with it. Does not own the routers or the data.

The order, from the micro-batch layout (`micro_batches`) and Megatron's MoE layer: a router reads the
layer's hidden states [s, b, h] flattened to [s * b, h], position-major (`logits.view(-1, E)`).
- padded ("bshd", tokens [b, s]): token (row j, position p) is entry p * b + j; right padding is -1;
- packed ("thd", tokens [1, T]): entry t is packed position t (samples one after the other from
  `micro.starts`), the tail padding -1;
- context parallel (packed): this rank's rows of the global padded packed row (`split.rows`, in local
  order); rows past a sample's real length are the CP padding, -1;
- sequence parallel (TP > 1): the MoE layer runs on this TP rank's slice of the sequence dimension,
  a contiguous 1/TP of the entries above (the micro-batch's sequence is padded to a multiple of TP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpc_rl.training.micro_batches import MicroBatch


@dataclass(frozen=True)
class RouterTokens:
    """Per token a router sees on this rank (router order): its sample slot and position; -1 = padding."""

    sample: torch.Tensor
    """[tokens] long: index into `micro.indices` (the sample's slot in the micro-batch), -1 for padding."""
    position: torch.Tensor
    """[tokens] long: position in the sample's token ids (0 for padding)."""

    @property
    def real(self) -> torch.Tensor:
        """[tokens] bool: True where the token belongs to a sample."""
        return self.sample >= 0

    def __len__(self) -> int:
        return int(self.sample.numel())


def _in_samples(rows: torch.Tensor, starts: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, position) of packed-row entries `rows` for samples at `starts` of `lengths` (-1 outside)."""
    begin = torch.tensor(starts, dtype=torch.long)
    slot = torch.searchsorted(begin, rows, right=True) - 1
    inside = slot >= 0
    clamped = slot.clamp(min=0)
    position = rows - begin[clamped]
    inside &= position < torch.tensor(lengths, dtype=torch.long)[clamped]
    return torch.where(inside, slot, -1), torch.where(inside, position, 0)


def router_tokens(micro: MicroBatch, *, sp_size: int = 1, sp_rank: int = 0) -> RouterTokens:
    """The router order of `micro`'s tokens on sequence-parallel rank `sp_rank` of `sp_size` (module docstring)."""
    lengths = list(micro.total_lengths)
    batch, seq = int(micro.tokens.shape[0]), int(micro.tokens.shape[1])
    if seq % sp_size:
        raise ValueError(f"micro-batch sequence length {seq} does not divide by the sequence-parallel size {sp_size}")
    if micro.packed:
        rows = (micro.context_parallel.rows.to("cpu", torch.long) if micro.context_parallel is not None
                else torch.arange(seq))
        sample, position = _in_samples(rows, list(micro.starts), lengths)
    else:  # [s, b] position-major
        position = torch.arange(seq).repeat_interleave(batch)
        sample = torch.arange(batch).repeat(seq)
        inside = position < torch.tensor(lengths, dtype=torch.long)[sample]
        sample, position = torch.where(inside, sample, -1), torch.where(inside, position, 0)
    share = len(sample) // sp_size
    cut = slice(sp_rank * share, (sp_rank + 1) * share)
    return RouterTokens(sample=sample[cut], position=position[cut])
