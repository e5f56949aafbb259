"""Per-token weight versions summarised without per-token Python work (partial_buffer, scheduler, train_batches)."""

from __future__ import annotations

import numpy as np

from hpc_rl.controller.train_batches import pack_samples
from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.rollout.partial_buffer import trained_token_staleness, version_range
from hpc_rl.rollout.scheduler import _sample_stats


def sample(index: int, versions: list[int], loss_mask: list[int] | None = None) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[1, 2],
                  response_token_ids=list(range(len(versions))), response_logprobs=[-0.5] * len(versions),
                  weight_versions=versions, loss_mask=loss_mask, status=SampleStatus.COMPLETED, reward=1.0)


def test_version_range_of_one_version_and_of_several() -> None:
    assert version_range([4] * 1000) == (4, 4)
    assert version_range([4, 4, 2, 7, 4]) == (2, 7)
    assert version_range([9]) == (9, 9)


def test_staleness_matches_the_per_token_definition() -> None:
    samples = [sample(0, [5] * 6), sample(1, [2, 3, 5, 5], loss_mask=[1, 0, 1, 1]), sample(2, [3, 4, 4])]
    current = 6
    lags = [current - v for s in samples for v, m in zip(s.weight_versions, s.effective_loss_mask()) if m]
    assert trained_token_staleness(samples, current) == (sum(lags) / len(lags), float(max(lags)))
    ranges = [version_range(s.weight_versions) for s in samples]  # as _sample_stats passes them (read once)
    assert trained_token_staleness(samples, current, ranges=ranges) == (sum(lags) / len(lags), float(max(lags)))


def test_sample_stats_count_samples_spanning_versions() -> None:
    stats = _sample_stats([[sample(0, [5] * 6), sample(1, [2, 3, 5, 5]), sample(2, [4, 4])]], current_version=6)
    assert stats["rollout/samples_spanning_versions"] == 1.0
    assert stats["rollout/staleness_max"] == 4.0


def test_packed_versions_are_every_token_in_order() -> None:
    samples = [sample(0, [5] * 3), sample(1, [2, 3, 5]), sample(2, [7])]
    arrays = pack_samples(samples, [0.0, 0.0, 0.0])
    assert arrays["weight_versions"].dtype == np.int64
    assert arrays["weight_versions"].tolist() == [5, 5, 5, 2, 3, 5, 7]
