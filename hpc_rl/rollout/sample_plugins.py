"""slime's rollout plug-ins around the samples, loaded by import path and signature-checked (`PLUGIN_KINDS`).

Owns calling them where slime does:

    --rollout-sample-hook-path (any number)  hook(args, sample, *, rollout_id=, evaluation=) -> Sample | None,
        sync or async, on every generated sample before its reward (rollout and eval); a returned Sample
        replaces it; only the keywords the hook names are passed (slime's rule)
    --rollout-sample-filter-path  fn(args, groups) -> None, on the kept groups: a sample it marks
        `sample.remove_sample = True` stays in its group (and in the group's reward normalisation) but is not
        trained (its loss mask becomes zeros)
    --rollout-all-samples-process-path  fn(args, all_groups, data_source) -> None, on every scored group of
        the rollout, those the dynamic-sampling filter dropped included; data_source is hpc_rl's PromptSource
    --custom-rollout-log-function-path  fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time)
        -> bool: True skips hpc_rl's own rollout/* scalars of that rollout
    --custom-eval-rollout-log-function-path  fn(rollout_id, args, data, extra_metrics) -> bool, data =
        {name: {"rewards", "truncated", "samples"}}: True skips the eval/<name>/* scalars

Not here: the reward post-processing (`controller.train_batches`), the trainer's hooks (`training`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.data.samples import Group, Sample, SampleStatus
from hpc_rl.plugins import load_plugin

HOOK_KEYWORDS = ("rollout_id", "evaluation")


def _accepted_keywords(fn: Callable[..., Any], keywords: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return keywords
    names = {p.name for p in parameters}
    return {key: value for key, value in keywords.items() if key in names}


@dataclass
class SamplePlugins:
    """The configured sample plug-ins (empty: none)."""

    hooks: list[Callable[..., Any]] = field(default_factory=list)
    sample_filter: Callable[..., Any] | None = None
    all_samples_process: Callable[..., Any] | None = None
    rollout_log: Callable[..., Any] | None = None
    eval_rollout_log: Callable[..., Any] | None = None

    @classmethod
    def from_config(cls, rollout: Any, evaluation: Any) -> SamplePlugins:
        def optional(kind: str, path: str | None) -> Callable[..., Any] | None:
            return load_plugin(kind, path) if path else None

        return cls(hooks=[load_plugin("sample_hook", path) for path in rollout.rollout_sample_hook_path],
                   sample_filter=optional("sample_filter", rollout.rollout_sample_filter_path),
                   all_samples_process=optional("all_samples_process", rollout.rollout_all_samples_process_path),
                   rollout_log=optional("rollout_log", rollout.custom_rollout_log_function_path),
                   eval_rollout_log=optional("eval_rollout_log", evaluation.custom_eval_rollout_log_function_path))

    async def apply_hooks(self, args: Any, sample: Sample, *, rollout_id: int | None, evaluation: bool) -> Sample:
        """The sample after every hook, in order (a failed sample is left alone)."""
        if sample.status is SampleStatus.FAILED:
            return sample
        for hook in self.hooks:
            result = hook(args, sample, **_accepted_keywords(hook, {"rollout_id": rollout_id,
                                                                    "evaluation": evaluation}))
            if inspect.isawaitable(result):
                result = await result
            if result is not None:
                if not isinstance(result, Sample):
                    raise TypeError(f"rollout sample hook {getattr(hook, '__qualname__', hook)!r} returned "
                                    f"{type(result).__name__}, expected Sample or None")
                sample = result
        return sample

    async def apply_hooks_to_group(self, args: Any, group: Group, *, rollout_id: int | None, evaluation: bool) -> None:
        if self.hooks:
            group[:] = [await self.apply_hooks(args, s, rollout_id=rollout_id, evaluation=evaluation) for s in group]

    def filter_kept(self, args: Any, kept: list[Group]) -> int:
        """Run the sample filter; samples it removed get an all-zero loss mask. Returns how many."""
        if self.sample_filter is None:
            return 0
        self.sample_filter(args, kept)
        removed = 0
        for sample in (s for g in kept for s in g):
            if getattr(sample, "remove_sample", False):
                sample.loss_mask = [0] * sample.response_length
                removed += 1
        return removed

    def process_all(self, args: Any, all_groups: list[Group], data_source: Any) -> None:
        if self.all_samples_process is not None:
            self.all_samples_process(args, sorted(all_groups, key=lambda g: g[0].index), data_source)

    def skip_rollout_scalars(self, rollout_id: int, args: Any, kept: list[Group], metrics: dict[str, float],
                             seconds: float) -> bool:
        """Call the custom rollout log function; True: it asked to skip hpc_rl's own rollout/* scalars."""
        if self.rollout_log is None:
            return False
        return bool(self.rollout_log(rollout_id, args, [s for g in kept for s in g], dict(metrics), seconds))

    def skip_eval_scalars(self, rollout_id: int | None, args: Any, per_dataset: list[tuple[str, list[Group]]],
                          metrics: dict[str, float]) -> bool:
        if self.eval_rollout_log is None:
            return False
        data = {name: {"rewards": [float(s.reward or 0.0) for g in groups for s in g],
                       "truncated": [s.status is SampleStatus.TRUNCATED for g in groups for s in g],
                       "samples": [s for g in groups for s in g]} for name, groups in per_dataset}
        return bool(self.eval_rollout_log(rollout_id, args, data, dict(metrics)))
