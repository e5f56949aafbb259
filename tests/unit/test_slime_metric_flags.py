"""Issue 26: slime's metric and reward-key flags (--log-passrate, --log-reward-category, --log-correct-samples,
--log-multi-turn, --reward-key, --eval-reward-key, --tb-experiment-name) with slime's meaning, from the flags
to the metrics the scheduler and the eval report (against a fake SGLang engine) and the reward step."""

from __future__ import annotations

import asyncio
import inspect
import math
from pathlib import Path
from typing import Any

import pytest

from hpc_rl.config import load_config
from hpc_rl.data.prompts import PromptRecord
from hpc_rl.data.samples import Sample
from hpc_rl.rewards.group import REWARD_CATEGORY, RewardSpec, reward_group
from hpc_rl.rollout.eval import run_eval
from hpc_rl.rollout.sample_metrics import SampleMetricOptions, correct_sample_stats, multi_turn_stats, pass_at_k
from hpc_rl.telemetry.scalars import tensorboard_dir
from tests.unit.controller_build import built_loop
from tests.unit.test_rollout_scheduler import Harness, encode, row, run_with


def sample(index: int, reward: float, length: int = 4, **metadata: Any) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[1], response_token_ids=[2] * length,
                  response_logprobs=[-0.5] * length, reward=reward, metadata=dict(metadata))


def test_pass_at_k_is_slimes_unbiased_estimator() -> None:
    groups = [[sample(i, r) for i, r in enumerate([1, 0, 0, 0])], [sample(i, r) for i, r in enumerate([1, 1, 0, 0])]]
    out = pass_at_k(groups)
    assert set(out) == {"pass@1", "pass@2", "pass@4"}
    assert out["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert out["pass@2"] == pytest.approx(((1 - math.comb(3, 2) / math.comb(4, 2)) + (1 - 1 / 6)) / 2)
    assert out["pass@4"] == 1.0


def test_correct_sample_and_multi_turn_stats() -> None:
    samples = [sample(0, 1, length=2), sample(1, 1, length=9), sample(2, 0, length=5, round_number=3)]
    samples[2].loss_mask = [1, 0, 0, 1, 1]
    correct = correct_sample_stats(samples, max_response_len=8)
    assert (correct["correct_length/p25"], correct["correct_length/p100"]) == (0.5, 0.5)  # 2 <= 2, 9 -> last
    assert correct["correct_entropy"] == pytest.approx(0.5)
    turns = multi_turn_stats(samples, max_response_len=8)
    assert turns["raw_response_length/response_length_max"] == 9.0
    assert turns["raw_response_length/response_length_clip_ratio"] == pytest.approx(1 / 3)
    assert turns["wo_obs_response_length/response_length_min"] == 2.0 and turns["multi_turn_metric/round_number_max"] == 3


def test_the_flags_reach_the_scheduler_and_the_eval() -> None:
    """--log-passrate etc. from the command line: rollout/pass@k and eval/<name>/pass@k appear in the metrics."""
    config = load_config([], ["--log-passrate", "--log-correct-samples", "--log-multi-turn",
                              "--log-reward-category", "why", "--rollout-max-response-len", "8"])
    options = SampleMetricOptions.from_config(config.logging, config.rollout)
    assert options == SampleMetricOptions(log_passrate=True, log_correct_samples=True, log_reward_category="why",
                                          log_multi_turn=True, max_response_len=8)

    async def reward(samples: list[Sample]) -> list[float]:
        for s in samples:
            s.metadata[REWARD_CATEGORY] = "ok" if row(s) % 2 else "wrong"
        return [float(row(s) % 2) if k % 2 else 0.0 for k, s in enumerate(samples)]

    async def body(h: Harness) -> None:
        scheduler = h.scheduler(reward_fn=reward, group_filter=None, partial_rollout=False, over_sampling_batch_size=2)
        scheduler.metric_options = options
        metrics = (await scheduler.run(0)).metrics
        assert {"rollout/pass@1", "rollout/pass@4", "rollout/error_cat/ok", "rollout/correct_length/p100",
                "rollout/raw_response_length/response_length_mean"} <= set(metrics)
        assert h.client is not None
        records = [PromptRecord(row=i, prompt=f"q{i}", label=None) for i in range(2)]
        evaluated = await run_eval(client=h.client, datasets=[("toy", records)], encoder=encode, reward_fn=reward,
                                   n_samples=2, sampling_params={"max_new_tokens": 3}, metric_options=options)
        assert evaluated["eval/toy/pass@2"] == pytest.approx(0.5) and "eval/toy/error_cat/wrong" in evaluated

    run_with(body)


def test_reward_key_and_category_from_a_reward_object(tmp_path: Path) -> None:
    """--reward-key picks the reward from the object a custom reward returns; --log-reward-category keeps the
    category; --eval-reward-key defaults to --reward-key (the eval's spec)."""
    rm = tmp_path / "rm.py"
    rm.write_text("async def score(args, sample):\n    return {'acc': 1.0, 'score': 0.25, 'why': 'format'}\n")
    config = load_config([], ["--custom-rm-path", f"{rm}:score", "--reward-key", "score",
                              "--log-reward-category", "why"])
    assert (config.rollout.reward_key, config.eval.eval_reward_key) == ("score", None)
    spec = RewardSpec(custom_rm_path=config.rollout.custom_rm_path, reward_key=config.rollout.reward_key,
                      category_key=config.logging.log_reward_category)
    samples = [sample(0, 0.0)]
    assert asyncio.run(reward_group(spec, samples)) == [0.25]
    assert samples[0].metadata[REWARD_CATEGORY] == "format"
    eval_config = load_config([], ["--reward-key", "score", "--eval-reward-key", "acc"])
    assert eval_config.eval.eval_reward_key == "acc"


def test_reward_specs_follow_the_flags(tmp_path: Path, in_repo: Path) -> None:
    """The controller's rollout and eval reward specs carry --reward-key / --eval-reward-key / the category."""
    config = load_config([in_repo / "configs" / "tiny_cpu.yaml"],
                         ["--reward-key", "score", "--eval-reward-key", "acc", "--log-reward-category", "why",
                          "--run-dir", str(tmp_path)])

    loop = built_loop(config, tmp_path)
    reward_fn, evaluate = loop.rollouts.scheduler.reward_fn, loop.evaluate
    spec = inspect.getclosurevars(reward_fn).nonlocals["spec"]
    assert (spec.reward_key, spec.category_key) == ("score", "why")
    eval_reward_fn = inspect.getclosurevars(evaluate).nonlocals["reward_fn"]
    assert inspect.getclosurevars(eval_reward_fn).nonlocals["eval_spec"].reward_key == "acc"


def test_tb_experiment_name_is_a_subdirectory(tmp_path: Path) -> None:
    config = load_config([], ["--tb-project-name", "proj", "--tb-experiment-name", "exp1"])
    assert tensorboard_dir(config, tmp_path) == str(tmp_path / "tensorboard" / "exp1")
    assert tensorboard_dir(load_config([]), tmp_path) == str(tmp_path / "tensorboard")
