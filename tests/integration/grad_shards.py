"""Test helper: the whole reduced gradients on every rank under Megatron's distributed optimizer."""

from __future__ import annotations

import torch


def gather_reduced_grads(ddp: torch.nn.Module) -> None:
    """Under Megatron's distributed optimizer each DP rank holds its shard of the reduced gradient (a
    reduce-scatter); all-gather the shards so every rank's `main_grad`s are the whole reduced gradients."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        if not bucket_group.ddp_config.use_distributed_optimizer:
            continue
        size, rank = bucket_group.intra_distributed_optimizer_instance_size, \
            bucket_group.intra_distributed_optimizer_instance_rank
        for bucket in bucket_group.buckets:
            if size > 1:
                local = shard_buffer(bucket.grad_data, size)[rank].clone()
                torch.distributed.all_gather_into_tensor(
                    bucket.grad_data, local, group=bucket_group.intra_distributed_optimizer_instance_group)
