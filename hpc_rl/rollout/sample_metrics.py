"""The optional per-rollout sample metrics slime logs on request (its --log-* flags), from scored groups.

Owns, as pure functions of the kept (or eval) groups: pass@k (`--log-passrate`: the unbiased estimator
1 - C(n - c, k) / C(n, k) per group, averaged, for k = 1, 2, 4, ... up to the group size; a sample with reward
1 is correct, as in slime), the share of each reward category (`--log-reward-category KEY`: the value under KEY
of the reward object a custom reward or reward server returned, which the reward step keeps in
`sample.metadata["reward_category"]`), the lengths and mean negative log-prob of the correct samples
(`--log-correct-samples`), and multi-turn lengths and round counts (`--log-multi-turn`: full response
length, trained tokens only, `metadata["round_number"]` set by a multi-turn generate function). Names follow
slime's (`pass@4`, `error_cat/<category>`, `correct_length/p50`, `raw_response_length/...`), under the caller's
prefix (`rollout/` or `eval/<name>/`). No I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hpc_rl.data.samples import Group
from hpc_rl.rewards.group import REWARD_CATEGORY


@dataclass(frozen=True, kw_only=True)
class SampleMetricOptions:
    """Which of slime's --log-* metrics to compute (all off: none)."""

    log_passrate: bool = False
    log_correct_samples: bool = False
    log_reward_category: str | None = None
    log_multi_turn: bool = False
    max_response_len: int = 1

    @classmethod
    def from_config(cls, logging: Any, rollout: Any) -> SampleMetricOptions:
        return cls(log_passrate=logging.log_passrate, log_correct_samples=logging.log_correct_samples,
                   log_reward_category=logging.log_reward_category, log_multi_turn=logging.log_multi_turn,
                   max_response_len=rollout.rollout_max_response_len)

    @property
    def any(self) -> bool:
        return self.log_passrate or self.log_correct_samples or self.log_multi_turn or bool(self.log_reward_category)


def _is_correct(reward: float | None) -> bool:
    return reward == 1


def pass_at_k(groups: list[Group]) -> dict[str, float]:
    """{"pass@k": mean over groups of 1 - C(n - c, k) / C(n, k)} for k = 1, 2, 4, ... <= group size."""
    if not groups or len(groups[0]) < 2:
        return {}
    size = min(len(g) for g in groups)
    out = {}
    for k in (2**i for i in range(int(math.log2(size)) + 1)):
        estimates = []
        for group in groups:
            n, c = len(group), sum(_is_correct(s.reward) for s in group)
            estimates.append(1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k))
        out[f"pass@{k}"] = sum(estimates) / len(estimates)
    return out


def reward_category_shares(samples: list[Any]) -> dict[str, float]:
    """{"error_cat/<category>": share of the samples}."""
    counts = Counter(str(s.metadata.get(REWARD_CATEGORY)) for s in samples)
    return {f"error_cat/{category}": count / len(samples) for category, count in sorted(counts.items())}


def correct_sample_stats(samples: list[Any], max_response_len: int) -> dict[str, float]:
    """Of the correct samples: the share whose length falls in each quarter of max_response_len
    (`correct_length/p25` .. `p100`) and their mean per-token negative log-prob (`correct_entropy`)."""
    correct = [s for s in samples if _is_correct(s.reward)]
    cuts = [max_response_len * q / 4 for q in (1, 2, 3)] + [max_response_len]
    counts = [0] * 4
    for sample in correct:
        counts[next((i for i, cut in enumerate(cuts) if sample.response_length <= cut), 3)] += 1
    out = {f"correct_length/p{25 * (i + 1)}": count / max(len(correct), 1) for i, count in enumerate(counts)}
    means = [-sum(logprobs) / len(logprobs) for logprobs in (s.column("response_logprobs") for s in correct)
             if len(logprobs)]
    out["correct_entropy"] = sum(means) / len(means) if means else 0.0
    return out


def multi_turn_stats(samples: list[Any], max_response_len: int) -> dict[str, float]:
    """Response lengths with and without the observation (loss-masked) tokens, and the round counts."""
    raw = [s.response_length for s in samples]
    trained = [sum(s.effective_loss_mask()) for s in samples]
    out = {"raw_response_length/response_length_mean": sum(raw) / len(raw),
           "raw_response_length/response_length_max": float(max(raw)),
           "raw_response_length/response_length_min": float(min(raw)),
           "raw_response_length/response_length_clip_ratio": sum(r >= max_response_len for r in raw) / len(raw),
           "wo_obs_response_length/response_length_mean": sum(trained) / len(trained),
           "wo_obs_response_length/response_length_max": float(max(trained)),
           "wo_obs_response_length/response_length_min": float(min(trained))}
    rounds = [float(s.metadata["round_number"]) for s in samples if "round_number" in s.metadata]
    if rounds:
        out |= {"multi_turn_metric/round_number_mean": sum(rounds) / len(rounds),
                "multi_turn_metric/round_number_max": max(rounds), "multi_turn_metric/round_number_min": min(rounds)}
    return out


def sample_metrics(groups: list[Group], options: SampleMetricOptions, prefix: str) -> dict[str, float]:
    """The metrics `options` asks for, each name under `prefix`."""
    samples = [s for g in groups for s in g]
    if not samples or not options.any:
        return {}
    out: dict[str, float] = {}
    if options.log_passrate:
        out |= pass_at_k(groups)
    if options.log_reward_category:
        out |= reward_category_shares(samples)
    if options.log_correct_samples:
        out |= correct_sample_stats(samples, options.max_response_len)
    if options.log_multi_turn:
        out |= multi_turn_stats(samples, options.max_response_len)
    return {prefix + name: value for name, value in out.items()}
