"""The context-parallel layout (pure): padding to 2*CP, the load-balanced chunk split, the gather order
and the positions each CP rank's rows hold. (Megatron's own rotary slicing is checked against it in
tests/integration/test_context_parallel.py, which imports Megatron.)"""

from __future__ import annotations

import pytest
import torch

from hpc_rl.training.context_parallel import (
    gather_order,
    local_positions,
    local_rows,
    packed_lengths,
    padded_length,
    split_packed,
)


def test_each_sequence_is_padded_to_a_multiple_of_two_cp() -> None:
    assert [padded_length(n, 2) for n in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    assert [padded_length(n, 3) for n in (1, 6, 7)] == [6, 6, 12]
    assert packed_lengths([5, 3], 2) == ([5, 3], [8, 4])


def test_sequence_parallel_adds_a_tail_sequence_so_each_rank_share_divides_by_tp() -> None:
    real, padded = packed_lengths([5, 3], 2, pad_multiple=4)  # 12 tokens -> 6 per CP rank -> 8 per rank
    assert padded == [8, 4, 4] and real == [5, 3, 4]
    assert (sum(padded) // 2) % 4 == 0
    real, padded = packed_lengths([5, 3], 2, pad_multiple=2)  # already 6 per rank
    assert padded == [8, 4]
    with pytest.raises(ValueError, match="cp_size"):
        packed_lengths([3], 0)


def test_rank_r_holds_chunks_r_and_mirror() -> None:
    # one sequence of 8 at CP=2: chunks of 2 -> rank 0 holds chunks 0, 3; rank 1 holds chunks 1, 2
    assert local_rows([8], 2, 0) == [0, 1, 6, 7]
    assert local_rows([8], 2, 1) == [2, 3, 4, 5]
    # two sequences: each split on its own, one after the other
    assert local_rows([4, 8], 2, 0) == [0, 3, 4, 5, 10, 11]
    assert local_rows([4, 8], 2, 1) == [1, 2, 6, 7, 8, 9]
    # CP=3, 12 tokens: chunks of 2; rank 1 holds chunks 1 and 4
    assert local_rows([12], 3, 1) == [2, 3, 8, 9]
    with pytest.raises(ValueError, match="multiple"):
        local_rows([6], 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        local_rows([8], 2, 2)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_ranks_partition_the_row_and_gather_order_restores_it(cp_size: int) -> None:
    padded = [padded_length(n, cp_size) for n in (1, 7, 13, 2 * cp_size)]
    gathered = [row for rank in range(cp_size) for row in local_rows(padded, cp_size, rank)]
    assert sorted(gathered) == list(range(sum(padded)))
    assert len({len(local_rows(padded, cp_size, r)) for r in range(cp_size)}) == 1  # equal shares
    order = gather_order(padded, cp_size)
    assert [gathered[i] for i in order] == list(range(sum(padded)))


def test_positions_restart_per_sequence_and_follow_the_chunks() -> None:
    assert local_positions([8, 4], 2, 0) == [0, 1, 6, 7, 0, 3]
    assert local_positions([8, 4], 2, 1) == [2, 3, 4, 5, 1, 2]


def test_causal_work_is_balanced() -> None:
    # sum over a rank's queries of the keys each sees (positions + 1): the same on every rank
    for cp_size in (2, 4):
        work = [sum(p + 1 for p in local_positions([16 * cp_size], cp_size, r)) for r in range(cp_size)]
        assert len(set(work)) == 1


def test_split_packed_gives_te_style_cu_seqlens() -> None:
    split = split_packed([5, 3], 2, 1, pad_multiple=4)
    assert split.cu_seqlens == [0, 5, 8, 12]  # real lengths (the SP tail counts as real)
    assert split.cu_seqlens_padded == [0, 8, 12, 16]
    assert split.starts == [0, 8, 12]
    assert split.rows.tolist() == local_rows([8, 4, 4], 2, 1)
    assert split.rows.dtype == torch.long and split.order.shape == (16,)


def test_config_refuses_context_parallel_with_the_padded_layout() -> None:
    from hpc_rl.config.sections.training import TrainingConfig

    assert TrainingConfig(context_parallel_size=2, qkv_format="thd").qkv_format == "thd"
    assert TrainingConfig(context_parallel_size=2).qkv_format == "auto"  # resolves to thd under CP
    with pytest.raises(ValueError, match="qkv_format: thd"):
        TrainingConfig(context_parallel_size=2, qkv_format="bshd")
