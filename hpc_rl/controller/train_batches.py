"""From a rollout's groups to each data-parallel rank's share, as flat arrays for the wire.

Owns: group reward normalisation (the rollout-side part of GRPO/GSPO/CISPO/REINFORCE++-baseline:
it needs whole groups, which the DP split breaks up), the token-balanced DP split (Karmarkar-Karp
with equal counts), and packing a list of samples into flat numpy arrays (concatenated tokens plus
per-sample lengths). Advantages per token, KL and losses are the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpc_rl.data.samples import Group, Sample
from hpc_rl.training.advantages import group_normalized_rewards
from hpc_rl.training.batching import balanced_partitions

NORMALIZED_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")


@dataclass(kw_only=True)
class RewardShaping:
    """The algorithm fields that decide how group rewards are normalised."""

    advantage_estimator: str
    n_samples_per_prompt: int
    std_normalization: bool = True
    disabled: bool = False


def normalized_rewards(groups: list[Group], shaping: RewardShaping) -> list[float]:
    """Per sample, in group order: r - mean (/ std for grpo-like) within its group, or raw."""
    raw = [float(s.reward if s.reward is not None else 0.0) for g in groups for s in g]
    if shaping.disabled or shaping.advantage_estimator not in NORMALIZED_ESTIMATORS:
        return raw
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups of unequal sizes {sorted(sizes)} cannot be normalised together")
    values = group_normalized_rewards(torch.tensor(raw, dtype=torch.float64), sizes.pop(),
                                      estimator=shaping.advantage_estimator,
                                      std_normalization=shaping.std_normalization)
    return [float(v) for v in values]


def pack_samples(samples: list[Sample], rewards: list[float]) -> dict[str, np.ndarray]:
    """Flat arrays of `samples` (order kept): what a trainer rank receives in a TrainCommand."""
    prompt_lengths = np.array([len(s.prompt_token_ids) for s in samples], dtype=np.int32)
    response_lengths = np.array([len(s.response_token_ids) for s in samples], dtype=np.int32)
    tokens = np.fromiter((t for s in samples for t in (*s.prompt_token_ids, *s.response_token_ids)),
                         dtype=np.int64, count=int(prompt_lengths.sum() + response_lengths.sum()))
    total_response = int(response_lengths.sum())
    loss_masks = np.fromiter((m for s in samples for m in s.effective_loss_mask()), dtype=np.uint8,
                             count=total_response)
    logprobs = np.fromiter((lp for s in samples for lp in s.response_logprobs), dtype=np.float32,
                           count=sum(len(s.response_logprobs) for s in samples))
    if len(logprobs) != total_response:
        raise ValueError("a sample has fewer rollout log-probs than response tokens")
    versions = np.fromiter((v for s in samples for v in s.weight_versions), dtype=np.int64,
                           count=sum(len(s.weight_versions) for s in samples))
    return {
        "tokens": tokens,
        "prompt_lengths": prompt_lengths,
        "response_lengths": response_lengths,
        "loss_masks": loss_masks,
        "rollout_logprobs": logprobs,
        "rewards": np.array(rewards, dtype=np.float32),
        "raw_rewards": np.array([float(s.reward or 0.0) for s in samples], dtype=np.float32),
        "sample_indices": np.array([s.index for s in samples], dtype=np.int64),
        "weight_versions": versions,
    }


def split_for_data_parallel(groups: list[Group], shaping: RewardShaping, dp_size: int) -> list[dict[str, np.ndarray]]:
    """One packed batch per DP rank; sample counts equal, token counts balanced."""
    samples = [s for g in groups for s in g]
    rewards = normalized_rewards(groups, shaping)
    if len(samples) % dp_size:
        raise ValueError(f"{len(samples)} samples cannot be split evenly over {dp_size} data-parallel ranks")
    parts = balanced_partitions([s.total_length for s in samples], dp_size) if dp_size > 1 else [
        list(range(len(samples)))]
    return [pack_samples([samples[i] for i in sorted(part)], [rewards[i] for i in sorted(part)]) for part in parts]


def unpack_samples(batch: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The inverse view of `pack_samples` (per sample: tokens, response slice, mask, logprobs)."""
    out = []
    token_offset = response_offset = 0
    for p, r in zip(batch["prompt_lengths"].tolist(), batch["response_lengths"].tolist()):
        out.append({
            "tokens": batch["tokens"][token_offset:token_offset + p + r],
            "prompt_length": p,
            "loss_mask": batch["loss_masks"][response_offset:response_offset + r],
            "rollout_logprobs": batch["rollout_logprobs"][response_offset:response_offset + r],
        })
        token_offset += p + r
        response_offset += r
    return out
