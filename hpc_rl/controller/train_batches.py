"""From a rollout's groups to each data-parallel rank's share, as flat arrays for the wire.

Owns: group reward normalisation (the rollout-side part of GRPO/GSPO/CISPO/REINFORCE++-baseline:
it needs whole groups, which the DP split breaks up; this is its only home), the token-balanced DP
split (Karmarkar-Karp with equal counts, `training.batching`'s pure-Python one), and packing a list
of samples into flat numpy arrays (concatenated tokens plus per-sample lengths; with rollout routing
replay the engines' routed experts too, rows concatenated). Advantages per token, KL and losses are
the trainer's. Also the packed arrays' memory kept across rollouts (`PackBuffers`, `PackLease`: when an array
may be filled again). numpy only: the controller never imports torch.
"""

from __future__ import annotations

import mmap
from array import array
from dataclasses import dataclass
from itertools import chain

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hpc_rl.data.images import IMAGE_REFS_ARRAY, image_refs_array
from hpc_rl.data.samples import Group, Sample
from hpc_rl.data.uniform_column import UniformColumn
from hpc_rl.training.batching import balanced_partitions

STD_NORMALIZED_ESTIMATORS = ("grpo", "gspo", "cispo")
NORMALIZED_ESTIMATORS = (*STD_NORMALIZED_ESTIMATORS, "reinforce_plus_plus_baseline")
GROUP_STD_EPS = 1e-6


def group_normalized_rewards(rewards: Sequence[float], n_samples_per_prompt: int, estimator: str = "grpo",
                             std_normalization: bool = True) -> np.ndarray:
    """Normalise scalar rewards within each group of `n_samples_per_prompt` consecutive samples.

    grpo/gspo/cispo: r~ = (r - mean_g) / (std_g + 1e-6), std_g the unbiased (n - 1) std; the division
    is skipped with `std_normalization=False` (Dr.GRPO, `--disable-grpo-std-normalization`) or when
    n == 1 (a one-sample std is undefined; r~ is then 0). reinforce_plus_plus_baseline: r - mean_g.
    Other estimators: rewards unchanged. Computed in float64, returned as float32 (the wire dtype).
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if estimator not in NORMALIZED_ESTIMATORS:
        return r.astype(np.float32)
    if n_samples_per_prompt < 1 or r.size % n_samples_per_prompt:
        raise ValueError(f"{r.size} rewards cannot be split into groups of n_samples_per_prompt={n_samples_per_prompt}")
    groups = r.reshape(-1, n_samples_per_prompt)
    centered = groups - groups.mean(axis=1, keepdims=True)
    if estimator in STD_NORMALIZED_ESTIMATORS and std_normalization and n_samples_per_prompt > 1:
        centered = centered / (groups.std(axis=1, ddof=1, keepdims=True) + GROUP_STD_EPS)
    return centered.reshape(-1).astype(np.float32)


@dataclass(kw_only=True)
class RewardShaping:
    """The algorithm fields that decide how group rewards are normalised."""

    advantage_estimator: str
    n_samples_per_prompt: int
    std_normalization: bool = True
    disabled: bool = False
    post_process: Callable[[list[Sample]], Any] | None = None
    """slime's --custom-reward-post-process-path, `args` bound: samples -> (raw_rewards, rewards)."""


def normalized_rewards(groups: list[Group], shaping: RewardShaping) -> list[float]:
    """Per sample, in group order: r - mean (/ std for grpo-like) within its group, or raw; or what the custom
    reward post-process function returns."""
    if shaping.post_process is not None:
        samples = [s for g in groups for s in g]
        result = shaping.post_process(samples)
        rewards = result[1] if isinstance(result, tuple) and len(result) == 2 else None
        if rewards is None or len(rewards) != len(samples):
            raise ValueError(f"rollout.custom_reward_post_process_path must return (raw_rewards, rewards) with "
                             f"{len(samples)} rewards each; got {type(result).__name__}")
        return [float(r) for r in rewards]
    raw = [float(s.reward if s.reward is not None else 0.0) for g in groups for s in g]
    if shaping.disabled or shaping.advantage_estimator not in NORMALIZED_ESTIMATORS:
        return raw
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups of unequal sizes {sorted(sizes)} cannot be normalised together")
    values = group_normalized_rewards(raw, sizes.pop(), estimator=shaping.advantage_estimator,
                                      std_normalization=shaping.std_normalization)
    return values.tolist()


Allocate = Callable[[str, int, type], np.ndarray]
"""(array name, length, dtype) -> an array of that length to fill: where `pack_samples` puts its per-token arrays."""


def fresh_array(name: str, size: int, dtype: type) -> np.ndarray:
    """`Allocate` without reuse: new memory for every array."""
    return np.empty(size, dtype=dtype)


class PackBuffers:
    """The per-token arrays of the train batches (tokens, log-probs, versions, loss masks), kept from one rollout's
    packing to the next: a rollout's are ~20 bytes per token (~100 MB at bench_scale's 2,048 full-length samples),
    and fresh memory is written page by page through faults (the packing's 0.14 CPU-s per rollout there was
    0.053 with reused arrays: 10,900 -> 4,150 minor faults, measured in the run).

    Safety: an array is handed out by one `PackLease` at a time (taking it removes it from here) and comes back
    only through `PackLease.release`, which its holder calls once nothing reads the arrays any more: for a
    TrainCommand, after every rank reported it done (each rank read its whole frame, so no transport, signer or
    buffer of the connection still holds a view of them). A lease never released (a command abandoned, an error)
    keeps its arrays: the next lease gets new ones. The arrays stay allocated between rollouts (RSS no higher than
    the packing's own peak)."""

    HEADROOM = 1.125
    """A new array is this much longer than asked, so that the next rollouts' slightly longer batches fit."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str], np.ndarray] = {}

    def lease(self) -> PackLease:
        """Arrays for one set of batches, from what earlier leases released."""
        return PackLease(self)


class PackLease:
    """The arrays of one set of batches (one `split_for_data_parallel`): taken from `PackBuffers`, given back by
    `release` when their batches were sent and read."""

    def __init__(self, buffers: PackBuffers) -> None:
        self._buffers = buffers
        self._taken: dict[tuple[int, str], np.ndarray] = {}

    def allocator(self, slot: int) -> Allocate:
        """`pack_samples`' `allocate` for batch `slot` (a DP rank's)."""
        def allocate(name: str, size: int, dtype: type) -> np.ndarray:
            key = (slot, name)
            if key in self._taken:
                raise RuntimeError(f"pack lease: batch {slot}'s {name} was already handed out")
            held = self._buffers._free.pop(key, None)
            if held is None or held.dtype != np.dtype(dtype) or len(held) < size:
                held = _small_page_array(int(size * PackBuffers.HEADROOM) + 1, dtype)
            self._taken[key] = held
            return held[:size]
        return allocate

    def release(self) -> None:
        """Nothing reads this lease's arrays any more: the next lease may fill them."""
        self._buffers._free.update(self._taken)
        self._taken = {}


def _small_page_array(size: int, dtype: type) -> np.ndarray:
    """An array in its own anonymous mapping of ordinary (4 kB) pages, for `PackBuffers`. numpy asks the kernel for
    huge pages for its large arrays (madvise MADV_HUGEPAGE), and where the kernel then compacts memory at the first
    touch (transparent_hugepage/defrag = madvise, as on this machine), the first rollout's packing into its ~100 MB
    of new arrays spent 0.27-0.29 s in the kernel (split 296-307 ms at bench_scale's N=256, 2,048 full-length
    samples); in ordinary pages 0.09 s (split 111-118 ms). Later rollouts reuse the arrays either way (~36 ms)."""
    itemsize = np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(1, size * itemsize)), dtype=dtype, count=size)


def pack_samples(samples: list[Sample], rewards: list[float], allocate: Allocate = fresh_array) -> dict[str, np.ndarray]:
    """Flat arrays of `samples` (order kept): what a trainer rank receives in a TrainCommand. `allocate` gives the
    per-token arrays' memory (`PackLease.allocator`: reused across rollouts; default: new)."""
    prompt_lengths = np.array([len(s.prompt_token_ids) for s in samples], dtype=np.int32)
    response_lengths = np.array([s.response_length for s in samples], dtype=np.int32)
    # Each sample's compact columns (data/samples.py) are copied as memory, not walked token by token (the
    # walk over lists was ~100 us per full-length sample at bench_scale's N=256, the top packing cost).
    tokens = _concatenate([part for s in samples for part in (s.prompt_token_ids, s.column("response_token_ids"))],
                          np.int64, allocate("tokens", int(prompt_lengths.sum()) + int(response_lengths.sum()),
                                             np.int64))
    total_response = int(response_lengths.sum())
    loss_masks = allocate("loss_masks", total_response, np.uint8)
    if all(s.loss_mask is None for s in samples):  # the common case: no per-token list to walk
        loss_masks.fill(1)
    else:
        loss_masks[:] = np.fromiter(chain.from_iterable(s.effective_loss_mask() for s in samples), dtype=np.uint8,
                                    count=total_response)
    logprob_parts = [s.column("response_logprobs") for s in samples]
    if sum(map(len, logprob_parts)) != total_response:
        raise ValueError("a sample has fewer rollout log-probs than response tokens")
    logprobs = _concatenate(logprob_parts, np.float32, allocate("rollout_logprobs", total_response, np.float32))
    version_parts = [s.column("weight_versions") for s in samples]  # (a sample made by hand may have none)
    versions = _pack_versions(version_parts, allocate("weight_versions", sum(map(len, version_parts)), np.int64))
    arrays = {
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
    teacher = _teacher_logprobs(samples, total_response)
    if teacher is not None:
        arrays["teacher_logprobs"] = teacher
    if any(s.routed_experts is not None for s in samples):
        arrays.update(pack_routed_experts(samples))
    if any(s.top_logprobs is not None for s in samples):
        arrays.update(pack_top_logprobs(samples))
    if any(s.images for s in samples):  # the trainer processes them with the checkpoint's image processor
        arrays[IMAGE_REFS_ARRAY] = image_refs_array([list(s.images) for s in samples])
    return arrays


_ARRAY_DTYPES = {"q": np.int64, "d": np.float64, "i": np.int32, "f": np.float32}
"""numpy's type of each compact column's typecode (narrow columns too: data/column_forms.py); the packed array's own
dtype is the caller's (`_concatenate` casts into it: a narrow column gives the same numbers)."""


def _as_numpy(values: Sequence[Any], dtype: type) -> np.ndarray:
    """A compact column viewed as numpy without a copy, or a list converted."""
    if isinstance(values, array) and values.typecode in _ARRAY_DTYPES and len(values):
        return np.frombuffer(values, dtype=_ARRAY_DTYPES[values.typecode])
    return np.asarray(values, dtype=dtype)


def _concatenate(parts: list[Sequence[Any]], dtype: type, out: np.ndarray | None = None) -> np.ndarray:
    """The parts (arrays or lists of numbers) as one `dtype` array (`out`, of their total length, when given),
    filled part by part (np.concatenate with a cast was 2.5x slower); the views into arrays end with the call."""
    if out is None:
        out = np.empty(sum(len(part) for part in parts), dtype=dtype)
    elif len(out) != sum(len(part) for part in parts):
        raise ValueError(f"{len(out)} values to fill from parts of {sum(len(part) for part in parts)}")
    position = 0
    for part in parts:
        end = position + len(part)
        if end > position:
            out[position:end] = _as_numpy(part, dtype)
        position = end
    return out


def pack_top_logprobs(samples: list[Sample]) -> dict[str, np.ndarray]:
    """Score centering: the engines' top-k ids and log-probs of every response token, [total response, k] each
    (one row per response token, samples in order)."""
    k = next(s.top_logprobs.shape[1] for s in samples if s.top_logprobs is not None)
    ids, logprobs = [], []
    for s in samples:
        if s.top_logprob_ids is None or s.top_logprobs is None:
            if s.response_length:
                raise ValueError(f"sample {s.index} has no top-k log-probs while others have: with "
                                 "algorithm.use_score_centering every sample must come from engine answers "
                                 "(a custom generate function must call generate_turn)")
            continue
        if s.top_logprobs.shape != (s.response_length, k) or s.top_logprob_ids.shape != (s.response_length, k):
            raise ValueError(f"sample {s.index}: top-k log-probs {s.top_logprobs.shape} / ids "
                             f"{s.top_logprob_ids.shape}, expected ({s.response_length}, {k})")
        ids.append(s.top_logprob_ids)
        logprobs.append(s.top_logprobs)
    return {"top_logprob_ids": np.concatenate(ids).astype(np.int32, copy=False),
            "top_logprobs": np.concatenate(logprobs).astype(np.float32, copy=False)}


def _pack_versions(per_sample: list[Sequence[int]], out: np.ndarray | None = None) -> np.ndarray:
    """The samples' per-token weight versions, concatenated (int64). A `UniformColumn` (data/uniform_column.py: the
    common case, one version throughout) or a list with one version throughout (`list.count` confirms it in one C
    pass) is a fill of its slice, not a copy of 8 bytes per token read; a compact column is copied as memory."""
    total = sum(map(len, per_sample))
    if out is None:
        out = np.empty(total, dtype=np.int64)
    elif len(out) != total:
        raise ValueError(f"{len(out)} values to fill from parts of {total}")
    position = 0
    for versions in per_sample:
        end = position + len(versions)
        if end == position:
            continue
        if isinstance(versions, UniformColumn):
            out[position:end] = versions.value
        elif isinstance(versions, list) and versions.count(versions[0]) == len(versions):
            out[position:end] = versions[0]
        else:
            out[position:end] = _as_numpy(versions, np.int64)
        position = end
    return out


def pack_routed_experts(samples: list[Sample]) -> dict[str, np.ndarray]:
    """The samples' routed experts as one [rows, num_layers, topk] array and the rows of each sample
    (rollout routing replay: every trained sample must carry the engine's routing)."""
    missing = [s.index for s in samples if s.routed_experts is None]
    if missing:
        raise ValueError(f"samples {missing[:8]} have no routed experts while others have: with "
                         "training.use_rollout_routing_replay every sample must come from an engine answer "
                         "(a custom generate function must call generate_turn)")
    routing = [s.routed_experts for s in samples]
    shapes = {r.shape[1:] for r in routing}
    if len(shapes) != 1:
        raise ValueError(f"samples' routed experts differ in [num_layers, topk]: {sorted(shapes)}")
    return {"routed_experts": np.concatenate(routing, axis=0),
            "routed_expert_rows": np.array([len(r) for r in routing], dtype=np.int32)}


def _teacher_logprobs(samples: list[Sample], total_response: int) -> np.ndarray | None:
    """On-policy distillation with a teacher server: every sample's teacher log-probs, concatenated (or None)."""
    if all(s.teacher_logprobs is None for s in samples):
        return None
    missing = [s.index for s in samples if s.teacher_logprobs is None or len(s.teacher_logprobs) != s.response_length]
    if missing:
        raise ValueError(f"samples {missing[:5]} have no teacher log-probs for every response token")
    return np.fromiter(chain.from_iterable(s.teacher_logprobs or () for s in samples), dtype=np.float32,
                       count=total_response)


def split_for_data_parallel(groups: list[Group], shaping: RewardShaping, dp_size: int,
                            lease: PackLease | None = None) -> list[dict[str, np.ndarray]]:
    """One packed batch per DP rank; sample counts equal, token counts balanced. `lease`: the per-token arrays
    are its (reused across rollouts: `PackBuffers`), batch i's from its slot i."""
    samples = [s for g in groups for s in g]
    rewards = normalized_rewards(groups, shaping)
    if len(samples) % dp_size:
        raise ValueError(f"{len(samples)} samples cannot be split evenly over {dp_size} data-parallel ranks")
    parts = balanced_partitions([s.total_length for s in samples], dp_size) if dp_size > 1 else [
        list(range(len(samples)))]
    return [pack_samples([samples[i] for i in sorted(part)], [rewards[i] for i in sorted(part)],
                         lease.allocator(slot) if lease is not None else fresh_array)
            for slot, part in enumerate(parts)]

