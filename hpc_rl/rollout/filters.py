"""Group filters (dynamic sampling) and buffer filters, with slime's signatures.

Owns:
- the dynamic-sampling filter contract, `fn(args, samples: list[Sample], **kwargs) -> bool | result`
  where a result is any object with a `keep` attribute and optionally `reason` (slime's
  `DynamicFilterOutput`); `filter_verdict` turns either into `(keep, reason)`;
- the built-in `check_reward_nonzero_std` (keep a group whose rewards are not all equal);
- the buffer filter contract, `fn(args, rollout_id, buffer: list[list[Sample]], num_samples: int)
  -> list[list[Sample]]`: it removes from `buffer` (in place) and returns the groups to resume;
  the built-in `pop_first` (FIFO);
- loading both by import path with a signature check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpc_rl.data.samples import Group, Sample

GroupFilter = Callable[..., Any]
BufferFilter = Callable[[Any, int, list[Group], int], list[Group]]


@dataclass
class FilterResult:
    """What a group filter decided (slime's `DynamicFilterOutput` shape)."""

    keep: bool
    reason: str | None = None
    """Why a group was dropped; becomes a metric `rollout/groups_dropped/<reason>`."""


def _reward_of(item: Sample | list[Sample]) -> float:
    sample = item[0] if isinstance(item, list) else item
    if sample.reward is None:
        raise ValueError(f"sample {sample.index} has no reward: filters run after rewards")
    return float(sample.reward)


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> FilterResult:
    """Keep the group if its rewards are not all the same (std > 1e-6): DAPO's dynamic sampling."""
    rewards = [_reward_of(s) for s in samples]
    mean = sum(rewards) / len(rewards)
    # Unbiased std as torch computes it; a single sample has no spread.
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) if len(rewards) > 1 else 0.0
    keep = std > 1e-6
    return FilterResult(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def filter_verdict(output: Any) -> tuple[bool, str | None]:
    """(keep, reason) from a filter's return value: a bool, or an object with `keep` (and `reason`)."""
    if hasattr(output, "keep"):
        keep = bool(output.keep)
        reason = getattr(output, "reason", None)
        return keep, (None if keep else (str(reason) if reason else "filter"))
    keep = bool(output)
    return keep, (None if keep else "filter")


def pop_first(args: Any, rollout_id: int, buffer: list[Group], num_samples: int) -> list[Group]:
    """FIFO: take the `num_samples` oldest groups out of `buffer`."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


def load_group_filter(path: str | None) -> GroupFilter | None:
    """`rollout.dynamic_sampling_filter_path` resolved and checked (None: no dynamic sampling)."""
    if path is None:
        return None
    from hpc_rl.plugins import load_plugin

    return load_plugin("dynamic_sampling_filter", path)


def load_buffer_filter(path: str | None) -> BufferFilter:
    """`rollout.buffer_filter_path` resolved and checked (None: `pop_first`)."""
    if path is None:
        return pop_first
    from hpc_rl.plugins import load_plugin

    return load_plugin("buffer_filter", path)
