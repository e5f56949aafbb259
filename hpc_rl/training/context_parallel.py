"""Context parallelism (CP): packed sequences split over the CP ranks, and the CPU twin of TE's CP attention.

Owns:
- the layout (pure functions of the lengths): every packed sequence is padded to a multiple of
  2*CP and cut into 2*CP equal chunks; CP rank r keeps chunks r and 2*CP-1-r, in that order, one
  sequence after the other. That is Megatron's / Transformer Engine's load-balanced causal split
  (under a causal mask an early chunk is cheap and a late one dear, so each rank gets one of each),
  and exactly what Megatron's THD rotary (`rope_utils._get_thd_freqs_on_this_cp_rank`, fed with
  `cu_seqlens_q_padded`) assumes: local sequence i has padded_i / CP rows, its first half at global
  positions [r*c, (r+1)*c) and its second half at [(2CP-1-r)*c, (2CP-r)*c), c = padded_i / (2*CP);
- two all-gathers over the CP group, differing only in their backward: `gather_with_reduce_scatter_grad`
  (K/V: every rank's queries read every rank's keys, so a K/V gradient is the sum over ranks) and
  `gather_with_local_grad` (per-position log-probs, after which every CP rank computes the same
  loss: the gradient of the gathered tensor is then identical on all ranks and each keeps its slice);
- `context_parallel_attention`, the CPU twin of TE's CP attention for `layer_specs.PackedSequenceAttention`:
  all-gather K and V, put each sequence back in global order, and let the local query chunks attend
  with a causal mask by global position. Same result as one rank holding the whole sequence.

Does not own the model inputs (`micro_batches` builds them from this layout) nor the process
groups (`parallel`). On GPU, TE's `DotProductAttention` does the attention itself (p2p ring by
default) from the same layout and `PackedSeqParams`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import torch
import torch.distributed as dist


def padded_length(length: int, cp_size: int) -> int:
    """`length` rounded up to a multiple of 2 * cp_size (each sequence splits into 2*CP equal chunks)."""
    step = 2 * cp_size
    return -(-length // step) * step


def packed_lengths(lengths: Sequence[int], cp_size: int, pad_multiple: int = 1) -> tuple[list[int], list[int]]:
    """(real, padded) lengths of the sequences of a packed CP micro-batch, tail dummy included.

    When each rank's share (total padded / CP) must be a multiple of `pad_multiple` (TP with sequence
    parallel), a dummy sequence of padding is appended (counted as real: it attends only to itself,
    as in the CP=1 layout); its length is a multiple of 2*CP too.
    """
    if cp_size < 1 or pad_multiple < 1:
        raise ValueError(f"cp_size ({cp_size}) and pad_multiple ({pad_multiple}) must be >= 1")
    real = [int(n) for n in lengths]
    padded = [padded_length(n, cp_size) for n in real]
    unit = math.lcm(2 * cp_size, cp_size * pad_multiple)
    tail = (-sum(padded)) % unit
    if tail:
        real.append(tail)
        padded.append(tail)
    return real, padded


@lru_cache(maxsize=256)
def _local_rows(padded: tuple[int, ...], cp_size: int, cp_rank: int) -> tuple[int, ...]:
    rows: list[int] = []
    offset = 0
    for length in padded:
        if length % (2 * cp_size):
            raise ValueError(f"packed sequence length {length} is not a multiple of 2 * cp_size = {2 * cp_size}")
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            rows.extend(range(offset + index * chunk, offset + (index + 1) * chunk))
        offset += length
    return tuple(rows)


def local_rows(padded: Sequence[int], cp_size: int, cp_rank: int) -> list[int]:
    """Rows of the global padded packed row that CP rank `cp_rank` holds, in its local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    return list(_local_rows(tuple(int(n) for n in padded), cp_size, cp_rank))


@lru_cache(maxsize=256)
def _gather_order(padded: tuple[int, ...], cp_size: int) -> tuple[int, ...]:
    gathered = [row for rank in range(cp_size) for row in _local_rows(padded, cp_size, rank)]
    order = [0] * len(gathered)
    for position, row in enumerate(gathered):
        order[row] = position
    return tuple(order)


def gather_order(padded: Sequence[int], cp_size: int) -> list[int]:
    """For each row of the global padded packed row, its position in the CP all-gather of the ranks'
    local rows ([rank 0's rows, rank 1's rows, ...]): `gathered[order]` is in global order."""
    return list(_gather_order(tuple(int(n) for n in padded), cp_size))


def local_positions(padded: Sequence[int], cp_size: int, cp_rank: int) -> list[int]:
    """Position inside its own sequence of each local row (the rotary position Megatron applies)."""
    rows = local_rows(padded, cp_size, cp_rank)
    out: list[int] = []
    index = 0
    for start, length in zip(accumulate(padded, initial=0), padded):
        share = int(length) // cp_size
        out.extend(row - start for row in rows[index: index + share])
        index += share
    return out


@dataclass(frozen=True)
class ContextParallelSplit:
    """One packed micro-batch's layout on one CP rank."""

    cp_size: int
    cp_rank: int
    real_lengths: list[int]
    """Per sequence, tail dummy included (TE's `cu_seqlens`)."""
    padded_lengths: list[int]
    """Per sequence, multiples of 2*CP (TE's `cu_seqlens_padded`, Megatron's rotary)."""
    rows: torch.Tensor
    """[T_local] rows of the global padded packed row held here, in local order."""
    order: torch.Tensor
    """[T_padded] positions in the CP all-gather of the global rows, in global order."""

    @property
    def starts(self) -> list[int]:
        """Offset of each sequence in the global padded packed row."""
        return self.cu_seqlens_padded[:-1]

    @property
    def cu_seqlens(self) -> list[int]:
        return list(accumulate(self.real_lengths, initial=0))

    @property
    def cu_seqlens_padded(self) -> list[int]:
        return list(accumulate(self.padded_lengths, initial=0))


def split_packed(lengths: Sequence[int], cp_size: int, cp_rank: int, *, pad_multiple: int = 1,
                 device: torch.device | str = "cpu") -> ContextParallelSplit:
    """The layout of sequences with these lengths on CP rank `cp_rank` (see `packed_lengths`)."""
    real, padded = packed_lengths(lengths, cp_size, pad_multiple)
    return ContextParallelSplit(
        cp_size=cp_size, cp_rank=cp_rank, real_lengths=real, padded_lengths=padded,
        rows=torch.tensor(local_rows(padded, cp_size, cp_rank), dtype=torch.long, device=device),
        order=torch.tensor(gather_order(padded, cp_size), dtype=torch.long, device=device),
    )


# ---------------------------------------------------------------------------------- collectives


def _all_gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tensor = tensor.contiguous()
    out = tensor.new_empty((dist.get_world_size(group) * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(out, tensor, group=group)
    return out


class _GatherReduceScatterGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather_rows(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad, group=ctx.group)
        return out, None


class _GatherLocalGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.rows, ctx.rank = tensor.shape[0], dist.get_rank(group)
        return _all_gather_rows(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad[ctx.rank * ctx.rows: (ctx.rank + 1) * ctx.rows], None


def gather_with_reduce_scatter_grad(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 (rank order); backward sums the gradient over ranks and returns this rank's rows.

    For tensors every rank consumes differently (K/V read by every rank's queries)."""
    return _GatherReduceScatterGrad.apply(tensor, group)


def gather_with_local_grad(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 (rank order); backward returns this rank's rows of the gradient, unsummed.

    For tensors from which every rank then computes the same value (the loss from per-position
    log-probs): summing would count that one loss CP times."""
    return _GatherLocalGrad.apply(tensor, group)


# ---------------------------------------------------------------------------------- CPU attention

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(query [sq, 1, heads, d], key [sk, 1, groups, d], value, mask [1, 1, sq, sk] True = masked) -> [sq, 1, hidden]."""


def packed_causal_mask(sequence_ends: torch.Tensor, total: int,
                       query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """[Q, T] bool, True = masked, over a packed row of `total` keys whose sequences end at
    `sequence_ends` (cumulative lengths): a key is visible iff it is in the query's sequence and not
    after it. Queries are all T positions, or `query_positions` (a CP rank's rows, by global position).
    """
    positions = torch.arange(total, device=sequence_ends.device)
    sequence = torch.searchsorted(sequence_ends, positions, right=True)
    queries = positions if query_positions is None else query_positions
    return (positions[None, :] > queries[:, None]) | (sequence[None, :] != sequence[queries][:, None])


def context_parallel_attention(attend: Attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               padded_lengths: Sequence[int], group: dist.ProcessGroup, *,
                               block_mask_max_tokens: int = 2048) -> torch.Tensor:
    """Causal attention of this rank's query chunks over the whole sequences' keys.

    q/k/v are this rank's rows, [T_local, heads or groups, d]; the result is [T_local, 1, hidden].
    K and V of the CP group are all-gathered (backward: reduce-scatter) and reordered into the
    global padded packed row. A key is visible to a query iff it is in the same sequence and not
    after it, by global position. Up to `block_mask_max_tokens` global rows this is one call with a
    block mask (masked scores are exactly 0 after the softmax); beyond, one call per sequence with
    the keys up to that sequence's last local query.
    """
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    padded = [int(n) for n in padded_lengths]
    device = query.device
    order = torch.tensor(gather_order(padded, cp_size), dtype=torch.long, device=device)
    rows = torch.tensor(local_rows(padded, cp_size, cp_rank), dtype=torch.long, device=device)
    key_width = key.shape[-1]  # MLA's keys are wider than its values: gathered side by side, split after
    both = gather_with_reduce_scatter_grad(torch.cat((key, value), dim=-1), group)
    both = both.index_select(0, order)  # [T_padded, groups, d_k + d_v] in global order
    all_keys, all_values = both[..., :key_width], both[..., key_width:]
    total = both.shape[0]
    if total <= block_mask_max_tokens:
        mask = packed_causal_mask(torch.tensor(padded, dtype=torch.long, device=device).cumsum(0), total, rows)
        return attend(query.unsqueeze(1), all_keys.unsqueeze(1).contiguous(), all_values.unsqueeze(1).contiguous(),
                      mask[None, None])
    outputs = []
    local_start = global_start = 0
    for length in padded:
        share = length // cp_size
        if share == 0:
            continue
        q_rows = rows[local_start: local_start + share] - global_start
        visible = int(q_rows.max()) + 1  # keys [0, visible) of this sequence can be seen
        mask = torch.arange(visible, device=device)[None, :] > q_rows[:, None]
        span = slice(global_start, global_start + visible)
        outputs.append(attend(query[local_start: local_start + share].unsqueeze(1),
                              all_keys[span].unsqueeze(1).contiguous(), all_values[span].unsqueeze(1).contiguous(),
                              mask[None, None]))
        local_start += share
        global_start += length
    return torch.cat(outputs, dim=0)
