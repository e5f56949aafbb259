"""`TrainBatch`: one DP rank's share of a rollout, as the trainer consumes it.

Owns: the per-sample view (token ids, prompt/response lengths, loss masks, normalised rewards,
rollout log-probs, the engines' routed experts and top-k log-probs for score centering, a VL model's images) and its conversion
from/to the flat numpy arrays the controller sends in a `TrainCommand`
(`hpc_rl.controller.train_batches.pack_samples`: concatenated tokens plus per-sample lengths) and from JSONL
rows (the `--batches-file` used before a controller exists).
`rewards` are already group-normalised (the rollout side does it: it sees whole groups). A teacher server's
log-probs (on-policy distillation, `teacher_logprobs`) travel beside the engine's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpc_rl.data.routed_experts import compact_expert_ids


@dataclass(kw_only=True)
class TrainBatch:
    """Samples of one rollout for this DP rank; all lists have one entry per sample."""

    tokens: list[list[int]]
    """Prompt + response token ids of each sample."""
    response_lengths: list[int]
    """Number of response tokens at the end of each sample."""
    loss_masks: list[list[int]]
    """Per response token: 1 = trained, 0 = ignored (tool output, off-policy partial tokens)."""
    rewards: list[float]
    """Per sample, after group normalisation (= the GRPO advantage of every response token)."""
    rollout_logprobs: list[list[float]] | None = None
    """Per response token, the engine's log-prob of the sampled token (None if not returned)."""
    routed_experts: list[np.ndarray] | None = None
    """Per sample, [rows, num_layers, topk] experts the engine routed its first `rows` tokens to
    (rollout routing replay; `hpc_rl.data.routed_experts`), None when the engines returned none."""
    teacher_logprobs: list[list[float]] | None = None
    """On-policy distillation with a teacher server: per response token, the teacher's log-prob of it."""
    top_logprob_ids: list[np.ndarray] | None = None
    """Score centering: per sample, [response tokens, k] ids of the engine's top-k at each response token."""
    top_logprobs: list[np.ndarray] | None = None
    """Score centering: per sample, [response tokens, k] engine log-probs of `top_logprob_ids` (-inf: none)."""
    images: list[dict[str, np.ndarray] | None] | None = None
    """Vision-language rollouts: per sample None (no image) or {"pixel_values": [patches, C*T*P*P] float,
    "image_grid_thw": [images, 3] int}, as transformers' image processor gives them for the sample's images in
    prompt order (the prompt's token ids hold each image's t*h*w / merge**2 pad tokens); None: a text batch."""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        self._total_lengths = [len(t) for t in self.tokens]
        for name in ("response_lengths", "loss_masks", "rewards"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries for {n} samples")
        for i, (toks, r, mask) in enumerate(zip(self.tokens, self.response_lengths, self.loss_masks)):
            if not 0 <= r < len(toks) or len(mask) != r:
                raise ValueError(f"sample {i}: response length {r} and loss mask {len(mask)} must be equal and "
                                 f"below the token count {len(toks)} (at least one prompt token)")
        for name in ("rollout_logprobs", "teacher_logprobs"):
            for i, (lp, r) in enumerate(zip(getattr(self, name) or [], self.response_lengths)):
                if len(lp) != r:
                    raise ValueError(f"sample {i}: {len(lp)} {name.replace('_', ' ')} for {r} response tokens")
        if self.images is not None:
            if len(self.images) != n:
                raise ValueError(f"TrainBatch.images has {len(self.images)} entries for {n} samples")
            for i, sample in enumerate(self.images):
                if sample is not None and (set(sample) != {"pixel_values", "image_grid_thw"}
                                           or int(np.prod(sample["image_grid_thw"], axis=-1).sum())
                                           != len(sample["pixel_values"])):
                    raise ValueError(f"sample {i}: images need pixel_values with one row per patch of "
                                     f"image_grid_thw (t*h*w summed over the images)")
        if self.routed_experts is not None:
            if len(self.routed_experts) != n:
                raise ValueError(f"TrainBatch.routed_experts has {len(self.routed_experts)} entries for {n} samples")
            for i, (routing, toks) in enumerate(zip(self.routed_experts, self.tokens)):
                if routing.ndim != 3 or len(routing) > len(toks):
                    raise ValueError(f"sample {i}: routed experts of shape {routing.shape} for {len(toks)} tokens "
                                     "(expected [rows <= tokens, num_layers, topk])")

        if (self.top_logprob_ids is None) != (self.top_logprobs is None):
            raise ValueError("TrainBatch.top_logprob_ids and top_logprobs come together")
        for ids, lps, r, i in zip(self.top_logprob_ids or [], self.top_logprobs or [], self.response_lengths,
                                  range(n)):
            if ids.ndim != 2 or ids.shape != lps.shape or len(ids) != r:
                raise ValueError(f"sample {i}: top-k ids {ids.shape} and log-probs {lps.shape} for {r} response "
                                 "tokens (expected [response tokens, k] each)")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def total_lengths(self) -> list[int]:
        """Prompt + response token count of each sample (computed once: the trainer indexes it per sample)."""
        return self._total_lengths

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """The samples at `indices`, in that order."""
        return TrainBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            loss_masks=[self.loss_masks[i] for i in indices],
            rewards=[self.rewards[i] for i in indices],
            rollout_logprobs=None if self.rollout_logprobs is None else [self.rollout_logprobs[i] for i in indices],
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in indices],
            teacher_logprobs=None if self.teacher_logprobs is None else [self.teacher_logprobs[i] for i in indices],
            top_logprob_ids=None if self.top_logprob_ids is None else [self.top_logprob_ids[i] for i in indices],
            top_logprobs=None if self.top_logprobs is None else [self.top_logprobs[i] for i in indices],
            images=None if self.images is None else [self.images[i] for i in indices],
            meta=dict(self.meta),
        )

    def images_of(self, indices: Sequence[int]) -> dict[str, torch.Tensor] | None:
        """The images of the samples at `indices`, concatenated in that order (the model's keyword arguments
        `pixel_values` and `image_grid_thw`); None when none of them has an image."""
        chosen = [self.images[i] for i in indices if self.images[i] is not None] if self.images is not None else []
        if not chosen:
            return None
        return {"pixel_values": torch.from_numpy(np.concatenate([c["pixel_values"] for c in chosen])).float(),
                "image_grid_thw": torch.from_numpy(np.concatenate([c["image_grid_thw"] for c in chosen])).long()}

    # ------------------------------------------------------------------ wire formats

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], meta: dict[str, Any] | None = None) -> TrainBatch:
        """From `pack_samples`' flat arrays (tokens, prompt_lengths, response_lengths, loss_masks, ...)."""
        prompt = arrays["prompt_lengths"].astype(np.int64).tolist()
        response = arrays["response_lengths"].astype(np.int64).tolist()
        tokens, masks, logprobs, teacher = [], [], [], []
        flat_logprobs, flat_teacher = arrays.get("rollout_logprobs"), arrays.get("teacher_logprobs")
        # each flat array to Python once, then sliced per sample (a numpy slice per sample costs ~1 us each)
        all_tokens = arrays["tokens"].astype(np.int64).tolist()
        all_masks = arrays["loss_masks"].astype(np.int64).tolist()
        all_logprobs = (flat_logprobs.astype(np.float64).tolist()
                        if flat_logprobs is not None and len(flat_logprobs) else None)
        all_teacher = flat_teacher.astype(np.float64).tolist() if flat_teacher is not None else None
        t_off = r_off = 0
        for p, r in zip(prompt, response):
            tokens.append(all_tokens[t_off : t_off + p + r])
            masks.append(all_masks[r_off : r_off + r])
            if all_logprobs is not None:
                logprobs.append(all_logprobs[r_off : r_off + r])
            if all_teacher is not None:
                teacher.append(all_teacher[r_off : r_off + r])
            t_off += p + r
            r_off += r
        routing = None
        if "routed_experts" in arrays:  # views of the received buffer, one per sample
            cuts = np.cumsum(arrays["routed_expert_rows"].astype(np.int64))[:-1]
            routing = np.split(arrays["routed_experts"], cuts)
        head_ids = head_lps = None
        if "top_logprobs" in arrays:  # [total response, k]: views, one per sample
            cuts = np.cumsum(np.asarray(response, dtype=np.int64))[:-1]
            head_ids = np.split(arrays["top_logprob_ids"], cuts)
            head_lps = np.split(arrays["top_logprobs"], cuts)
        images = None
        if "image_grid_thw" in arrays:  # per sample: its images' rows of image_grid_thw and pixel_values
            grid_cuts = np.cumsum(arrays["image_counts"].astype(np.int64))[:-1]
            grids = np.split(arrays["image_grid_thw"], grid_cuts)
            pixel_cuts = np.cumsum([int(np.prod(g, axis=-1).sum()) for g in grids])[:-1]
            pixels = np.split(arrays["pixel_values"], pixel_cuts)
            images = [None if not len(g) else {"pixel_values": p, "image_grid_thw": g} for g, p in zip(grids, pixels)]
        return cls(top_logprob_ids=head_ids, top_logprobs=head_lps, images=images,
                   tokens=tokens, response_lengths=response, loss_masks=masks,
                   rewards=arrays["rewards"].astype(np.float64).tolist(),
                   rollout_logprobs=logprobs if logprobs else None, routed_experts=routing,
                   teacher_logprobs=teacher if flat_teacher is not None else None, meta=dict(meta or {}))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The flat-array form (inverse of `from_arrays`)."""
        prompt = [len(t) - r for t, r in zip(self.tokens, self.response_lengths)]
        out = {
            "tokens": np.array([t for toks in self.tokens for t in toks], dtype=np.int64),
            "prompt_lengths": np.array(prompt, dtype=np.int32),
            "response_lengths": np.array(self.response_lengths, dtype=np.int32),
            "loss_masks": np.array([m for mask in self.loss_masks for m in mask], dtype=np.uint8),
            "rewards": np.array(self.rewards, dtype=np.float32),
        }
        if self.rollout_logprobs is not None:
            out["rollout_logprobs"] = np.array([x for lp in self.rollout_logprobs for x in lp], dtype=np.float32)
        if self.teacher_logprobs is not None:
            out["teacher_logprobs"] = np.array([x for lp in self.teacher_logprobs for x in lp], dtype=np.float32)
        if self.routed_experts is not None:
            out["routed_experts"] = np.concatenate(self.routed_experts, axis=0)
            out["routed_expert_rows"] = np.array([len(r) for r in self.routed_experts], dtype=np.int32)
        if self.images is not None:
            present = [sample for sample in self.images if sample is not None]
            out["image_counts"] = np.array([0 if s is None else len(s["image_grid_thw"]) for s in self.images],
                                           dtype=np.int32)
            out["image_grid_thw"] = (np.concatenate([s["image_grid_thw"] for s in present]).astype(np.int64)
                                     if present else np.zeros((0, 3), dtype=np.int64))
            out["pixel_values"] = (np.concatenate([s["pixel_values"] for s in present]).astype(np.float32)
                                   if present else np.zeros((0, 0), dtype=np.float32))
        if self.top_logprob_ids is not None and self.top_logprobs is not None:
            out["top_logprob_ids"] = np.concatenate(self.top_logprob_ids).astype(np.int32, copy=False)
            out["top_logprobs"] = np.concatenate(self.top_logprobs).astype(np.float32, copy=False)
        return out

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> TrainBatch:
        """From JSON rows {"tokens", "response_length", "reward", optional "loss_mask", "rollout_logprobs",
        "routed_experts" ([rows][num_layers][topk] ids)}."""
        masks = [list(row.get("loss_mask") or [1] * int(row["response_length"])) for row in rows]
        has_lp = all(row.get("rollout_logprobs") is not None for row in rows)
        has_routing = all(row.get("routed_experts") is not None for row in rows)
        return cls(tokens=[list(map(int, row["tokens"])) for row in rows],
                   response_lengths=[int(row["response_length"]) for row in rows], loss_masks=masks,
                   rewards=[float(row["reward"]) for row in rows],
                   rollout_logprobs=[list(map(float, row["rollout_logprobs"])) for row in rows] if has_lp else None,
                   routed_experts=[compact_expert_ids(np.asarray(row["routed_experts"], dtype=np.int64))
                                   for row in rows] if has_routing else None)


def read_batches_file(path: str | Path) -> Iterator[TrainBatch]:
    """A JSONL file where each line is one rollout: {"samples": [row, ...]} (rows as in `from_rows`)."""
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                yield TrainBatch.from_rows(record["samples"])
            except (KeyError, ValueError, TypeError) as error:
                raise ValueError(f"{path}:{number}: bad rollout batch: {error}") from error
