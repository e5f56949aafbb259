"""Eval datasets follow the prompt-length rule training prompts follow (issue 24 gave it to training only): a
prompt that leaves the engines no room for a response is left out of every eval, counted in
eval/<name>/prompts_too_long and said once; a dataset of only such prompts is refused when the run starts."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpc_rl.config.loading import load_config
from hpc_rl.controller.rollout_stack import make_evaluate
from hpc_rl.data.prompts import DataError, DataKeys
from hpc_rl.data.samples import Sample
from hpc_rl.rollout.eval import eval_prompt_length_limit
from tests.unit.test_rollout_scheduler import Harness, run_with

REPO = Path(__file__).resolve().parents[2]


def encode(prompt: Any, metadata: dict[str, Any]) -> list[int]:
    """`q<row>` is 2 tokens (the fake engine reads the row from the second); each extra word adds 10."""
    words = str(prompt).split()
    return [10, int(words[0][1:])] + [7] * 10 * (len(words) - 1)


async def no_reward(samples: list[Sample]) -> list[float]:
    return [0.0] * len(samples)


def eval_config(tmp_path: Path, prompts: list[str], *flags: str):
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    return load_config([REPO / "configs/tiny_cpu.yaml"], ["--eval-prompt-data", "toy", str(data),
                                                          "--n-samples-per-eval-prompt", "1", *flags])


def test_long_eval_prompts_are_left_out_counted_and_said_once(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="hpc_rl.rollout.eval")
    config = eval_config(tmp_path, ["q0", "q1 long", "q2", "q3 long long", "q4"], "--rollout-max-context-len", "10")
    config.eval.eval_max_response_len = 4

    async def body(h: Harness) -> None:
        assert h.client is not None
        evaluate = make_evaluate(config, h.client, DataKeys(input_key="prompt", label_key="label"), encode,
                                 no_reward, None)
        assert evaluate is not None
        for rollout_id in (0, 1):  # old: every prompt was sent, the long ones answered with nothing
            metrics = await evaluate(0, rollout_id)
            assert metrics["eval/toy/num_samples"] == 3 and metrics["eval/toy/prompts_too_long"] == 2

    run_with(body)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["eval dataset toy: 2 of 5 prompts are longer than 9 tokens (rollout_max_context_len - 1: room for "
                    "one response token; data row 1 has 12): they are left out of every eval, counted in "
                    "eval/toy/prompts_too_long (said once)"]


def test_an_eval_dataset_of_only_long_prompts_is_refused_naming_it(tmp_path: Path) -> None:
    config = eval_config(tmp_path, ["q0 long", "q1 long"], "--eval-max-prompt-len", "5")
    client = SimpleNamespace(context_length=None)
    with pytest.raises(DataError, match=r"eval dataset toy: every one of its 2 prompts is longer than 5 tokens "
                                        r"\(eval_max_prompt_len; data row 0 has 12\)"):
        make_evaluate(config, client, DataKeys(input_key="prompt", label_key="label"), encode, no_reward, None)


def test_the_eval_limit_follows_the_training_rule() -> None:
    rollout = SimpleNamespace(rollout_max_context_len=None)
    evaluation = SimpleNamespace(eval_max_prompt_len=None, eval_max_context_len=None)
    assert eval_prompt_length_limit(evaluation, rollout, None) == (None, "")
    limit, why = eval_prompt_length_limit(evaluation, rollout, 512)
    assert limit is not None and limit < 512 and why.startswith("the engines' context length 512")
    rollout.rollout_max_context_len = 300
    assert eval_prompt_length_limit(evaluation, rollout, 512) == (299, "rollout_max_context_len - 1: room for one "
                                                                      "response token")
    evaluation.eval_max_context_len = 200
    assert eval_prompt_length_limit(evaluation, rollout, 512)[0] == 199
    evaluation.eval_max_prompt_len = 50
    assert eval_prompt_length_limit(evaluation, rollout, 512) == (50, "eval_max_prompt_len")
