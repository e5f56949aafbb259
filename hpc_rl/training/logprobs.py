"""Per-token log-probs and entropy from vocab-parallel logits (TP-sharded last dim).

Owns: the numerically stable softmax statistics across TP ranks (max, sum-exp and the target logit
all-reduced; backward is the identity on each rank's shard, as in Megatron's vocab-parallel cross
entropy), masking of the padded vocabulary rows. Which positions belong to which sample is
`micro_batches`'. At TP=1 this equals `log_softmax(logits)[target]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_MASKED = -1e30  # finite, so 0 * masked stays 0 in the entropy sum


def _sum_over_tp(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(tensor, group=group)


def _this_shard(logits: torch.Tensor, vocab_size: int,
                tp_group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int, int]:
    """This TP rank's float32 logits with the padded vocabulary masked, its first vocabulary id and its width."""
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    logits = logits.float()
    part = logits.shape[-1]
    start = tp_rank * part
    if start + part > vocab_size:
        padded = torch.arange(start, start + part, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, _MASKED)
    return logits, start, part


def _shifted_log_sum_exp(logits: torch.Tensor, vocab_size: int, tp_group: dist.ProcessGroup | None
                         ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """This rank's shard of `logits` less the (detached) maximum over the whole vocabulary, the log of the sum of
    exps over the whole vocabulary, and the shard's first id and width (what every log-prob here is built from)."""
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    logits, start, part = _this_shard(logits, vocab_size, tp_group)
    maximum = logits.detach().max(dim=-1, keepdim=True).values
    if tp_size > 1:
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - maximum
    return shifted, _sum_over_tp(shifted.exp().sum(dim=-1), tp_group).log(), start, part


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    chunk_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and (optionally) entropy, per position; `logits` [..., V_local], `targets` [...].

    Vocabulary entries >= `vocab_size` (Megatron's padding) get probability 0. `chunk_size` > 0 (slime's
    --log-probs-chunk-size) computes them that many positions at a time, so the float32 softmax
    intermediates are [chunk_size, V_local] instead of one per position of the whole micro-batch.
    """
    positions = targets.numel()
    if 0 < chunk_size < positions:
        flat_logits, flat_targets = logits.reshape(positions, logits.shape[-1]), targets.reshape(positions)
        parts = [vocab_parallel_logprobs(flat_logits[i:i + chunk_size], flat_targets[i:i + chunk_size],
                                         vocab_size=vocab_size, tp_group=tp_group, with_entropy=with_entropy)
                 for i in range(0, positions, chunk_size)]
        log_probs = torch.cat([lp for lp, _ in parts]).reshape(targets.shape)
        entropy = torch.cat([e for _, e in parts]).reshape(targets.shape) if with_entropy else None  # type: ignore[misc]
        return log_probs, entropy
    shifted, log_sum_exp, start, part = _shifted_log_sum_exp(logits, vocab_size, tp_group)
    local = targets.long() - start
    in_shard = (local >= 0) & (local < part)
    target_logit = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum_over_tp(target_logit * in_shard, tp_group)
    log_probs = target_logit - log_sum_exp
    entropy = None
    if with_entropy:
        probs = torch.exp(shifted - log_sum_exp.unsqueeze(-1))
        entropy = log_sum_exp - _sum_over_tp((probs * shifted).sum(dim=-1), tp_group)
    return log_probs, entropy


@torch.no_grad()
def vocab_parallel_greedy_hits(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                               tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """1.0 where the target is the argmax of the (unpadded) vocabulary, per position (ties count as hits):
    greedy decoding would emit it. `logits` [..., V_local] vocab-parallel, `targets` [...]."""
    logits, start, part = _this_shard(logits, vocab_size, tp_group)
    maximum = logits.max(dim=-1).values
    local = targets.long() - start
    in_shard = (local >= 0) & (local < part)
    target_logit = torch.where(in_shard, logits.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1),
                               torch.full_like(maximum, _MASKED))
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=tp_group)
        dist.all_reduce(target_logit, op=dist.ReduceOp.MAX, group=tp_group)
    return (target_logit >= maximum).float()


def vocab_parallel_head_logprobs(logits: torch.Tensor, ids: torch.Tensor, *, vocab_size: int,
                                 tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """log p(id) for k ids per position (score centering's head): `logits` [N, V_local] vocab-parallel, `ids`
    [N, k] -> [N, k], normalised over the whole (unpadded) vocabulary, with a gradient through the logits."""
    shifted, log_sum_exp, start, part = _shifted_log_sum_exp(logits, vocab_size, tp_group)
    local = ids.long() - start
    in_shard = (local >= 0) & (local < part)
    head = _sum_over_tp(shifted.gather(-1, local.clamp(0, part - 1)) * in_shard, tp_group)
    return head - log_sum_exp.unsqueeze(-1)
