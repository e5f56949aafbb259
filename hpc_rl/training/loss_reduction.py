"""How a micro-batch's per-token loss terms become one number: slime's reducers and the step's loss scale.

Owns: "sum of sample means" (slime's default) and the per-token sum (`--calculate-per-token-loss`), the mean over
one micro-batch's trained tokens, and the scale that makes a step's gradient independent of the micro-batching.
Pure torch on plain tensors (per-token tensors of a micro-batch are 1-D: the samples' response tokens
concatenated; the per-sample ``loss_masks`` give each sample's length). Users' custom losses reach these through
`hpc_rl.training.losses` (its `__all__`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

PerSample = Sequence[Tensor]
"""One tensor per sample of a micro-batch."""


def _segments(values: Tensor | PerSample, loss_masks: PerSample) -> tuple[Tensor, Tensor, Tensor]:
    """(values, masks) concatenated over samples, and each token's sample index: one tensor op per
    reduction instead of one per sample (a micro-batch has hundreds of short samples)."""
    x = values if isinstance(values, Tensor) else torch.cat(list(values))
    lengths = [int(m.numel()) for m in loss_masks]
    if x.numel() != sum(lengths):
        raise ValueError(f"values have {x.numel()} tokens but the loss masks cover {sum(lengths)}")
    m = torch.cat(list(loss_masks)).to(device=x.device, dtype=x.dtype)
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=x.device),
                                     torch.tensor(lengths, device=x.device))
    return x, m, sample


def sum_of_sample_mean(values: Tensor | PerSample, loss_masks: PerSample) -> Tensor:
    """Sum over samples of each sample's masked mean: sum_i (sum_t m_it x_it) / max(sum_t m_it, 1).

    ``values``: the concatenated per-token tensor of the micro-batch (split by the masks' lengths)
    or a list of per-sample tensors. This is slime's default reduction; dividing the step's total by
    ``global_batch_size`` (see :func:`step_loss_scale`) gives the mean over samples.
    """
    if len(loss_masks) == 0:
        return torch.zeros(())
    x, m, sample = _segments(values, loss_masks)
    count = len(loss_masks)
    numerator = torch.zeros(count, dtype=x.dtype, device=x.device).index_add(0, sample, x * m)
    denominator = torch.zeros(count, dtype=x.dtype, device=x.device).index_add(0, sample, m)
    return (numerator / denominator.clamp_min(1)).sum()


def sum_of_tokens(values: Tensor | PerSample, loss_masks: PerSample) -> Tensor:
    """Masked sum over all tokens: sum_i sum_t m_it x_it (``--calculate-per-token-loss``).

    Divide the step's total by the step's total trained-token count (summed over micro-batches and
    DP ranks) to get the per-token mean.
    """
    if len(loss_masks) == 0:
        return torch.zeros(())
    x, m, _ = _segments(values, loss_masks)
    return (x * m).sum()


def masked_token_mean(values: Tensor | PerSample, loss_masks: PerSample) -> Tensor:
    """Mean over the trained tokens of ONE micro-batch: sum_of_tokens / max(total mask, 1)."""
    count = float(torch.cat(list(loss_masks)).sum()) if len(loss_masks) else 0.0
    return sum_of_tokens(values, loss_masks) / max(count, 1.0)


def step_loss_scale(global_batch_size: int, *, dp_size: int = 1, num_microbatches: int = 1) -> float:
    """Factor for each micro-batch's sum-of-sample-means loss so a step's gradient = mean over samples.

    Summing ``sum_of_sample_mean(...) / global_batch_size`` over every micro-batch of every DP rank
    gives (1/B) * sum over the B samples of their per-sample mean losses, whatever the
    micro-batching: each sample's term appears exactly once. Two framework corrections:
      * ``dp_size``: DDP averages (not sums) gradients over DP ranks, so multiply back by dp_size
        (use the DP size *with* context parallel if CP ranks also average; with Megatron's
        ``calculate_per_token_loss`` DDP sums: pass 1, see ``optimizer.grad_sum_loss_multiplier``).
      * ``num_microbatches``: Megatron's pipeline schedule divides each micro-batch's loss by the
        number of micro-batches; multiply back by it.
    scale = num_microbatches * dp_size / global_batch_size.
    """
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be > 0, got {global_batch_size}")
    return num_microbatches * dp_size / global_batch_size
