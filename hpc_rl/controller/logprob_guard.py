"""The train/rollout log-prob mismatch after a sync, and the run's failure when it is too large.

Owns `LogprobGuard`: which weight version the engines serve (told by every sync), and the check after a
rollout is trained. When every token of the rollout was generated with the version the trainer held
before training, and that version reached the engines through a sync, the trainer's log-probs of those
tokens before its first update (`train/first_step_train_rollout_logprob_abs_diff`, the mean |old - rollout|
per token) measure only how the engines compute the same weights: ~1e-7 in float32 on CPU, ~1e-2 with bf16
kernels on GPUs. A larger gap means the engines serve other weights or another precision (a failed or
misrouted update; SGLang's `auto` dtype serving a float32 checkpoint in float16 gave 2.8e-4), and the run
stops with `LogprobMismatch` naming the rollout, the gap and the threshold. Rollouts with older tokens
(async, `update_weights_interval` > 1, partial rollouts) are measured, not checked; so are rollouts after a sync
that kept the engines' cache (in-place updates, `--flush-cache-interval` other than 1): real SGLang's prefix cache
then still holds KV of the older weights, which new requests of the same prompt reuse although every token
reports the new version (0.057 per token on the tiny run; the CPU engine has no prefix cache).
"""

from __future__ import annotations

import logging
from typing import Any

from hpc_rl.data.samples import Group
from hpc_rl.rollout.partial_buffer import version_range

log = logging.getLogger(__name__)

FIRST_STEP_GAP = "train/first_step_train_rollout_logprob_abs_diff"
DEFAULT_THRESHOLDS = {"cpu": 1e-4, "cuda": 0.1}
"""controller.max_logprob_mismatch when unset, by cluster.device: float32 twins agree to ~1e-7 (the float16
mistake is 2.8e-4); bf16 SGLang against bf16 Megatron differ by ~1e-2 per token, a wrong update by far more."""


FP8_ENGINES_THRESHOLD = 0.1
"""The default when the engines serve a block-FP8 checkpoint (FP8 rollouts, the trainer in bf16/fp32): FP8's
rounding (up to 2**-4 of each weight) is a real gap, 0.003-0.03 per token on the tiny run right after a sync
(benchmarks/bench_fp8_sync.py mismatch), which TIS corrects; it is checked as the GPU's bf16 gap is."""


class LogprobMismatch(RuntimeError):
    """After a sync, the engines' log-probs are not the trainer's (see the module docstring)."""


def threshold_for(device: str, configured: float | None, *, fp8_engines: bool = False) -> float | None:
    """The threshold in force: the configured one (<= 0: no check), else the default (FP8 engines': theirs)."""
    if configured is None:
        return FP8_ENGINES_THRESHOLD if fp8_engines else DEFAULT_THRESHOLDS.get(device)
    return configured if configured > 0 else None


def generated_with(groups: list[Group], version: int) -> bool:
    """Every generated token of every sample came from weight version `version`."""
    spans = [version_range(versions) for versions in (s.column("weight_versions") for g in groups for s in g)
             if len(versions)]
    return bool(spans) and all(span == (version, version) for span in spans)


class LogprobGuard:
    """Knows what the engines serve; checks each trained rollout against the threshold."""

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.served_version: int | None = None
        """The version the last sync pushed (None before any: the engines serve the checkpoint they loaded)."""
        self.cache_flushed = True
        """The last sync flushed the engines' cache (False: in place, their prefix cache may hold older KV)."""

    def note_served(self, version: int, *, cache_flushed: bool = True) -> None:
        self.served_version, self.cache_flushed = version, cache_flushed

    def check(self, rollout_id: int, groups: list[Group], trainer_version: int, metrics: dict[str, Any]) -> None:
        """Raise LogprobMismatch when rollout `rollout_id` was generated entirely with the synced version the
        trainer held, that sync flushed the engines' cache, and its first step's gap exceeds the threshold."""
        gap = metrics.get(FIRST_STEP_GAP)
        if self.threshold is None or gap is None or self.served_version != trainer_version or not self.cache_flushed:
            return
        if not float(gap) > self.threshold:  # the cheap test first: the per-sample scan only for a gap over it
            return
        if generated_with(groups, trainer_version):
            raise LogprobMismatch(
                f"rollout {rollout_id}: the engines' log-probs differ from the trainer's by {float(gap):.3g} per token "
                f"(mean |trainer - rollout|) right after weight sync v{trainer_version}; the limit is "
                f"{self.threshold:g} (controller.max_logprob_mismatch). The engines serve other weights or another "
                "precision than the trainer: a failed or misrouted update, or an engine dtype (sglang dtype) other "
                "than the trainer's")
