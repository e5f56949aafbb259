"""Eval rollouts: every prompt of each `eval_prompt_data` dataset, `n_samples_per_eval_prompt` samples each.

Owns: loading the eval datasets (each with its own data keys and sampling when an --eval-config file gave
them: `dataset_keys`, `dataset_sampling`), generating them with the eval sampling overrides (no dynamic
sampling, no buffer, nothing aborted), scoring per prompt group, and the metrics

    eval/<name>/reward_mean        mean reward over all samples
    eval/<name>/pass@1             mean over prompts of the share of samples with reward > 0
    eval/<name>/response_len_mean  mean response tokens
    eval/<name>/truncated_ratio    share of samples that hit the length limit
    eval/<name>/failed_samples     samples whose generation failed (scored as reward 0, not correct)
    eval/<name>/prompts_too_long   prompts left out of every eval: longer than `eval_prompt_length_limit`
                                   (the rule training prompts follow), counted at load and said once

Runs in its own `GenerationSession`, so it can overlap a training rollout: if that rollout's abort_all
hits eval requests, they come back aborted and are resumed (not lost).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hpc_rl.data.prompts import (DataError, DataKeys, PromptDataset, PromptEncoder, PromptRecord, encode_record,
                                 make_group)
from hpc_rl.data.samples import Group, SampleStatus
from hpc_rl.rollout.engine_client import EngineClient
from hpc_rl.rollout.sample_metrics import SampleMetricOptions, sample_metrics
from hpc_rl.rollout.sample_plugins import SamplePlugins
from hpc_rl.rollout.generate import (
    GenerateFn,
    GenerationSession,
    RetryPolicy,
    SamplingParams,
    default_generate,
    run_generate,
)
from hpc_rl.rollout.scheduler import RewardFn, length_limit

log = logging.getLogger(__name__)


def eval_prompt_length_limit(evaluation: Any, rollout: Any, engine_context_len: int | None) -> tuple[int | None, str]:
    """The longest eval prompt, and why: `eval_max_prompt_len` (slime's --eval-max-prompt-len); else, as for
    rollouts, the eval's context length (`eval_max_context_len`, else `rollout_max_context_len`) - 1; else what
    the engines' context leaves room for; None when nothing bounds it."""
    return length_limit([("eval_max_prompt_len", evaluation.eval_max_prompt_len)],
                        [("eval_max_context_len", evaluation.eval_max_context_len),
                         ("rollout_max_context_len", rollout.rollout_max_context_len)], engine_context_len)


def drop_long_prompts(name: str, records: list[PromptRecord], encoder: PromptEncoder, max_prompt_len: int,
                      why: str = "eval_max_prompt_len") -> tuple[list[PromptRecord], int]:
    """(the records whose encoded prompt has at most `max_prompt_len` tokens, how many were left out), with one
    warning naming the count and the first such data row; a dataset of only such prompts is a DataError."""
    kept, first_dropped, dropped = [], None, 0
    for record in records:
        length = len(encode_record(encoder, record))
        if length <= max_prompt_len:
            kept.append(record)
            continue
        dropped += 1
        first_dropped = first_dropped or (record.row, length)
    if first_dropped is None:
        return kept, 0
    row, length = first_dropped
    if not kept:
        raise DataError(f"eval dataset {name}: every one of its {len(records)} prompts is longer than {max_prompt_len} "
                        f"tokens ({why}; data row {row} has {length}); shorten them or raise the limit")
    log.warning("eval dataset %s: %d of %d prompts are longer than %d tokens (%s; data row %d has %d): they are left "
                "out of every eval, counted in eval/%s/prompts_too_long (said once)", name, dropped, len(records),
                max_prompt_len, why, row, length, name)
    return kept, dropped


def dataset_keys(dataset: Any, keys: DataKeys) -> DataKeys:
    """The data keys of one eval dataset: its own (an --eval-config file's), else `keys`."""
    return DataKeys(input_key=dataset.input_key or keys.input_key, label_key=dataset.label_key or keys.label_key,
                    metadata_key=dataset.metadata_key or keys.metadata_key, tool_key=dataset.tool_key or keys.tool_key,
                    multimodal_keys=keys.multimodal_keys)


def dataset_sampling(dataset: Any, n_samples: int, params: SamplingParams) -> tuple[int, SamplingParams]:
    """(samples per prompt, sampling params) of one eval dataset: its own settings over the eval section's."""
    own = {"temperature": dataset.temperature, "top_p": dataset.top_p, "top_k": dataset.top_k,
           "max_new_tokens": dataset.max_response_len, "min_new_tokens": dataset.min_new_tokens,
           "stop": dataset.stop, "stop_token_ids": dataset.stop_token_ids}
    return (dataset.n_samples_per_eval_prompt or n_samples,
            {**params, **{key: value for key, value in own.items() if value is not None}})


def load_eval_datasets(evaluation: Any, keys: DataKeys) -> list[tuple[str, list[PromptRecord]]]:
    """(name, records) for each `EvalConfig.eval_prompt_data` entry (each with its own keys, if it has any)."""
    return [(d.name, PromptDataset.load(d.path, dataset_keys(d, keys)).records) for d in evaluation.eval_prompt_data]


async def _eval_group(group: Group, fn: GenerateFn, args: Any, params: SamplingParams,
                      session: GenerationSession, reward_fn: RewardFn, plugins: SamplePlugins,
                      rollout_id: int | None) -> None:
    await asyncio.gather(*(run_generate(fn, args, s, params, session) for s in group))
    await plugins.apply_hooks_to_group(args, group, rollout_id=rollout_id, evaluation=True)
    scored = [s for s in group if s.status is not SampleStatus.FAILED]
    rewards = await reward_fn(scored) if scored else []
    for sample, reward in zip(scored, rewards):
        sample.reward = float(reward)
    for sample in group:
        if sample.status is SampleStatus.FAILED:
            sample.reward = 0.0


def eval_metrics(name: str, groups: list[Group]) -> dict[str, float]:
    """The per-dataset metrics from scored groups."""
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    prefix = f"eval/{name}/"
    return {
        prefix + "reward_mean": sum(float(s.reward or 0.0) for s in samples) / len(samples),
        prefix + "pass@1": sum(sum((s.reward or 0.0) > 0 for s in g) / len(g) for g in groups) / len(groups),
        prefix + "response_len_mean": sum(s.response_length for s in samples) / len(samples),
        prefix + "truncated_ratio": sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples),
        prefix + "failed_samples": float(sum(s.status is SampleStatus.FAILED for s in samples)),
        prefix + "num_samples": float(len(samples)),
    }


async def run_eval(*, client: EngineClient, datasets: list[tuple[str, list[PromptRecord]]], encoder: PromptEncoder,
                   reward_fn: RewardFn, n_samples: int, sampling_params: SamplingParams, args: Any = None,
                   generate_fn: GenerateFn = default_generate, weight_version: int = 0,
                   max_context_len: int | None = None, retry: RetryPolicy | None = None,
                   metric_options: SampleMetricOptions | None = None, plugins: SamplePlugins | None = None,
                   rollout_id: int | None = None,
                   per_dataset: dict[str, tuple[int, SamplingParams]] | None = None) -> dict[str, float]:
    """Generate and score every dataset (all concurrently, limited by the client); return the metrics."""
    session = GenerationSession(client, weight_version=weight_version, retry=retry, max_context_len=max_context_len,
                                batch_across_groups=True)  # every eval group is waited for
    next_index = 0
    settings = per_dataset or {}
    generated: list[tuple[str, list[Group]]] = []
    for name, records in datasets:
        count = settings.get(name, (n_samples, sampling_params))[0]
        groups = []
        for row, record in enumerate(records):
            groups.append(make_group(record, group_index=row, first_sample_index=next_index, n_samples=count,
                                     prompt_token_ids=encode_record(encoder, record)))
            next_index += count
        generated.append((name, groups))
    plugins = plugins or SamplePlugins()
    tasks = [asyncio.create_task(_eval_group(g, generate_fn, args, settings.get(name, (n_samples, sampling_params))[1],
                                             session, reward_fn, plugins, rollout_id))
             for name, groups in generated for g in groups]
    try:
        await asyncio.gather(*tasks)
    finally:
        if any(not t.done() for t in tasks):  # cancelled or a reward error: leave the engines clean
            await session.stop()
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # read every outcome (the first error is raised)
    metrics: dict[str, float] = {}
    for name, groups in generated:
        metrics.update(eval_metrics(name, groups))
        if metric_options is not None:
            metrics.update(sample_metrics(groups, metric_options, f"eval/{name}/"))
    if plugins.skip_eval_scalars(rollout_id, args, generated, metrics):
        metrics = {}
    metrics.update(session.metrics.as_dict(prefix="eval/"))
    return metrics
