"""Issue 26: slime's rollout plug-ins with slime's signatures, loaded from their flags and called where slime calls
them (against a fake SGLang engine): sample hooks, the sample filter, the all-samples process, the rollout and eval
log functions, and the reward post-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpc_rl.config import load_config
from hpc_rl.config.validation import collect_problems
from hpc_rl.controller.train_batches import split_for_data_parallel
from hpc_rl.controller.trainers import reward_shaping
from hpc_rl.data.prompts import PromptRecord
from hpc_rl.data.samples import Sample
from hpc_rl.rollout.eval import run_eval
from hpc_rl.rollout.sample_plugins import SamplePlugins
from tests.unit.test_rollout_scheduler import Harness, encode, half_constant_reward, row, run_with

PLUGINS = '''
calls = []

def tag(args, sample):
    sample.metadata["tagged"] = True

async def rename(args, sample, *, rollout_id=None, evaluation=False):
    calls.append(("hook", rollout_id, evaluation, sample.reward))
    sample.response_text = "renamed"
    return sample

def drop_odd_rows(args, samples):
    for group in samples:
        for s in group:
            s.remove_sample = int(s.metadata["data_row"]) % 2 == 1

def see_all(args, all_samples, data_source):
    calls.append(("all", len(all_samples), type(data_source).__name__))

def quiet_log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    calls.append(("log", rollout_id, len(samples), "rollout/reward_mean" in rollout_extra_metrics))
    return True

def quiet_eval_log(rollout_id, args, data, extra_metrics):
    calls.append(("eval_log", rollout_id, sorted(data), len(data["toy"]["rewards"])))
    return True

def post_process(args, samples):
    raw = [s.reward for s in samples]
    return raw, [10.0 * r for r in raw]

def wrong_signature(args):
    return None
'''


@pytest.fixture
def plugin_module(tmp_path: Path) -> Path:
    path = tmp_path / "my_plugins.py"
    path.write_text(PLUGINS)
    return path


def _loaded(plugin_module: Path, *flags: str) -> tuple[Any, SamplePlugins]:
    config = load_config([], [flag.replace("M:", f"{plugin_module}:") for flag in flags])
    return config, SamplePlugins.from_config(config.rollout, config.eval)


def test_hooks_filter_process_and_log_around_a_rollout(plugin_module: Path) -> None:
    config, plugins = _loaded(plugin_module, "--rollout-sample-hook-path", "M:tag", "--rollout-sample-hook-path",
                              "M:rename", "--rollout-sample-filter-path", "M:drop_odd_rows",
                              "--rollout-all-samples-process-path", "M:see_all",
                              "--custom-rollout-log-function-path", "M:quiet_log")
    assert config.rollout.rollout_sample_hook_path == [f"{plugin_module}:tag", f"{plugin_module}:rename"]  # repeats add
    calls = plugins.rollout_log.__globals__["calls"]  # type: ignore[union-attr]

    async def body(h: Harness) -> None:
        scheduler = h.scheduler(reward_fn=half_constant_reward, partial_rollout=False)
        scheduler.plugins = plugins
        result = await scheduler.run(3)
        samples = [s for g in result.groups for s in g]
        assert all(s.metadata["tagged"] and s.response_text == "renamed" for s in samples)  # both hooks, in order
        hooked = [c for c in calls if c[0] == "hook"]
        assert hooked and all(c[1:] == (3, False, None) for c in hooked)  # before the reward, with the rollout id
        for s in samples:  # the filter's samples stay in their group, untrained
            assert (s.effective_loss_mask() == [0] * s.response_length) == (row(s) % 2 == 1)
        assert not [k for k in result.metrics if k.startswith("rollout/")]  # the log function asked to skip them
        dropped = [c for c in calls if c[0] == "all"][0]
        assert dropped[1] > len(result.groups) and dropped[2] == "PromptSource"  # the filtered-out groups too
        assert ("log", 3, len(samples), True) in calls

    run_with(body)


def test_eval_hooks_and_eval_log_function(plugin_module: Path) -> None:
    _, plugins = _loaded(plugin_module, "--rollout-sample-hook-path", "M:rename",
                         "--custom-eval-rollout-log-function-path", "M:quiet_eval_log")
    calls = plugins.eval_rollout_log.__globals__["calls"]  # type: ignore[union-attr]

    async def reward(samples: list[Sample]) -> list[float]:
        return [1.0] * len(samples)

    async def body(h: Harness) -> None:
        assert h.client is not None
        records = [PromptRecord(row=i, prompt=f"q{i}", label=None) for i in range(2)]
        metrics = await run_eval(client=h.client, datasets=[("toy", records)], encoder=encode, reward_fn=reward,
                                 n_samples=2, sampling_params={"max_new_tokens": 3}, plugins=plugins, rollout_id=7)
        assert not [k for k in metrics if k.startswith("eval/toy/")]  # the log function asked to skip them
        assert ("eval_log", 7, ["toy"], 4) in calls and ("hook", 7, True, None) in calls

    run_with(body)


def test_reward_post_process_replaces_the_normalisation(plugin_module: Path) -> None:
    config, _ = _loaded(plugin_module, "--custom-reward-post-process-path", "M:post_process")
    from hpc_rl.plugins import load_plugin

    post = load_plugin("reward_post_process", config.rollout.custom_reward_post_process_path)
    shaping = reward_shaping(config.algorithm, 2, lambda samples: post(None, samples))
    groups = [[Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[1], response_token_ids=[2],
                      response_logprobs=[-0.1], weight_versions=[0], reward=float(i)) for i in range(2)]]
    (batch,) = split_for_data_parallel(groups, shaping, 1)
    assert np.allclose(batch["rewards"], [0.0, 10.0]) and np.allclose(batch["raw_rewards"], [0.0, 1.0])


def test_plugin_signatures_are_checked_at_submit(plugin_module: Path) -> None:
    flags = ["--rollout-sample-hook-path", "M:wrong_signature", "--rollout-sample-filter-path", "M:wrong_signature",
             "--custom-rollout-log-function-path", "M:wrong_signature", "--custom-reward-post-process-path",
             "M:wrong_signature", "--custom-megatron-before-train-step-hook-path", "M:wrong_signature",
             "--rollout-data-postprocess-path", "M:wrong_signature"]
    config = load_config([], [f.replace("M:", f"{plugin_module}:") for f in flags])
    where = {p.where for p in collect_problems(config, check_files=False)}
    assert {"rollout.rollout_sample_hook_path", "rollout.rollout_sample_filter_path",
            "rollout.custom_rollout_log_function_path", "rollout.custom_reward_post_process_path",
            "training.custom_megatron_before_train_step_hook_path", "algorithm.rollout_data_postprocess_path"} <= where
