"""Filters, buffer filters, the partial buffer's checkpoint, staleness and off-policy masking (pure)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.rollout.filters import (
    check_reward_nonzero_std,
    filter_verdict,
    load_buffer_filter,
    load_group_filter,
    pop_first,
)
from hpc_rl.rollout.partial_buffer import (
    PartialRolloutBuffer,
    mask_offpolicy,
    reset_sample,
    trained_token_staleness,
    violates_staleness,
)


def group(rewards: list[float | None], group_index: int = 0) -> list[Sample]:
    return [Sample(index=group_index * 10 + k, group_index=group_index, prompt="p", prompt_token_ids=[1],
                   reward=r) for k, r in enumerate(rewards)]


def test_check_reward_nonzero_std() -> None:
    assert check_reward_nonzero_std(None, group([1.0, 0.0, 1.0])).keep
    dropped = check_reward_nonzero_std(None, group([1.0, 1.0]))
    assert not dropped.keep and dropped.reason == "zero_std_1.0"
    assert filter_verdict(dropped) == (False, "zero_std_1.0")
    assert not check_reward_nonzero_std(None, group([0.5])).keep


def test_filter_verdict_accepts_bool_and_objects() -> None:
    assert filter_verdict(True) == (True, None)
    assert filter_verdict(False) == (False, "filter")
    assert filter_verdict(SimpleNamespace(keep=False)) == (False, "filter")
    assert filter_verdict(SimpleNamespace(keep=True, reason="x")) == (True, None)


def test_plugins_load_by_path() -> None:
    fn = load_group_filter("hpc_rl.rollout.filters.check_reward_nonzero_std")
    assert fn is check_reward_nonzero_std
    assert load_group_filter(None) is None
    assert load_buffer_filter(None) is pop_first
    assert load_buffer_filter("hpc_rl.rollout.filters.pop_first") is pop_first


def test_buffer_fifo_and_exact_checkpoint() -> None:
    buffer = PartialRolloutBuffer()
    groups = [group([None, None], g) for g in range(3)]
    groups[0][0].response_token_ids, groups[0][0].response_logprobs = [5, 6], [-0.1, -0.2]
    groups[0][0].weight_versions, groups[0][0].status = [1, 2], SampleStatus.ABORTED
    groups[0][1].loss_mask = []
    buffer.add(groups, rollout_id=4)
    assert all(s.metadata["start_rollout_id"] == 4 for g in groups for s in g)
    state = json.loads(json.dumps(buffer.state_dict()))
    restored = PartialRolloutBuffer()
    restored.load_state_dict(state)
    assert restored.state_dict() == buffer.state_dict()
    taken = restored.take(rollout_id=5, num_groups=2)
    assert [g[0].group_index for g in taken] == [0, 1] and len(restored) == 1
    assert taken[0][0].response_token_ids == [5, 6] and taken[0][0].status is SampleStatus.ABORTED
    assert taken[0][0].metadata["start_rollout_id"] == 4  # not overwritten when it comes back later
    restored.add(taken[:1], rollout_id=6)
    assert restored.groups[-1][0].metadata["start_rollout_id"] == 4


def test_buffer_filter_that_does_not_remove_is_safe() -> None:
    buffer = PartialRolloutBuffer(lambda args, rid, buf, n: list(reversed(buf))[:n])
    buffer.add([group([None], g) for g in range(3)], rollout_id=0)
    assert [g[0].group_index for g in buffer.take(1, 2)] == [2, 1]
    assert [g[0].group_index for g in buffer.groups] == [0]


def test_staleness_rule_and_reset() -> None:
    sample = group([None])[0]
    assert not violates_staleness(sample, 10, 1)  # no tokens yet
    sample.response_token_ids, sample.response_logprobs, sample.weight_versions = [1, 2, 3], [0.0] * 3, [3, 4, 5]
    assert not violates_staleness(sample, 5, None)
    assert not violates_staleness(sample, 5, 2)  # oldest token 3: lag 2
    assert violates_staleness(sample, 6, 2)
    assert reset_sample(sample) == 3 and sample.response_length == 0 and sample.status is SampleStatus.PENDING


def test_mask_offpolicy() -> None:
    sample = group([None])[0]
    sample.response_token_ids, sample.weight_versions = [1, 2, 3, 4], [0, 0, 1, 1]
    sample.loss_mask = [1, 0, 1, 1]  # a tool token stays masked
    assert mask_offpolicy(sample, 1) == 1 and sample.loss_mask == [0, 0, 1, 1]
    fresh = group([None])[0]
    fresh.response_token_ids, fresh.weight_versions = [1], [1]
    assert mask_offpolicy(fresh, 1) == 0 and fresh.loss_mask is None


def versioned_group(group_index: int, versions: list[list[int]]) -> list[Sample]:
    """A partial group whose k-th sample has generated one token per entry of versions[k]."""
    samples = group([None] * len(versions), group_index)
    for sample, tokens in zip(samples, versions):
        sample.response_token_ids = [7] * len(tokens)
        sample.response_logprobs = [-0.5] * len(tokens)
        sample.weight_versions = list(tokens)
    return samples


def test_sort_by_staleness_resumes_the_oldest_version_groups_first() -> None:
    # FIFO order: g0 (oldest token v3), g1 (no tokens yet), g2 (v1), g3 (v3, ties g0), g4 (v2 via its 2nd sample)
    groups = [versioned_group(0, [[3, 4]]), versioned_group(1, [[]]), versioned_group(2, [[1, 2]]),
              versioned_group(3, [[3]]), versioned_group(4, [[5], [2, 5]])]
    fifo = PartialRolloutBuffer()
    fifo.add([list(g) for g in groups], rollout_id=0)
    assert [g[0].group_index for g in fifo.take(rollout_id=1, num_groups=5)] == [0, 1, 2, 3, 4]
    stale_first = PartialRolloutBuffer(sort_by_staleness=True)
    stale_first.add(groups, rollout_id=0)
    assert [g[0].group_index for g in stale_first.take(rollout_id=1, num_groups=2)] == [2, 4]
    assert [g[0].group_index for g in stale_first.take(rollout_id=1, num_groups=3)] == [0, 3, 1]
    assert len(stale_first) == 0


def test_an_explicit_buffer_filter_takes_precedence_over_sort_by_staleness() -> None:
    def last_first(args, rollout_id, buffer, num_samples):  # a user's filter: newest group first
        return [buffer.pop() for _ in range(min(num_samples, len(buffer)))]
    buffer = PartialRolloutBuffer(last_first, sort_by_staleness=True)
    buffer.add([versioned_group(0, [[1]]), versioned_group(1, [[5]])], rollout_id=0)
    assert [g[0].group_index for g in buffer.take(rollout_id=1, num_groups=1)] == [1]


def test_trained_token_staleness_counts_the_tokens_the_loss_trains() -> None:
    a, b = versioned_group(0, [[2, 3, 5], [5]])
    a.loss_mask = [1, 0, 1]  # the v3 token is not trained (a tool output, or masked off-policy)
    # current version 5: trained lags a: [3, 0], b: [0] -> mean 1, max 3
    assert trained_token_staleness([a, b], current_version=5) == (1.0, 3.0)
    assert trained_token_staleness([b], current_version=5) == (0.0, 0.0)
    assert trained_token_staleness(versioned_group(1, [[]]), current_version=5) == (0.0, 0.0)
