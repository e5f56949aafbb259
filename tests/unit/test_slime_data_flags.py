"""Issue 26: slime's data and eval flags (--apply-chat-template-kwargs, --eval-input-key/-label-key/-tool-key,
--eval-max-prompt-len, --eval-max-context-len, --eval-min-new-tokens) with slime's meaning, as the controller
builds its eval from them."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from hpc_rl.config import load_config
from hpc_rl.data.prompts import make_prompt_encoder
from tests.unit.controller_build import built_loop


class RecordingTokenizerForTest:
    """A fake tokenizer: records the chat template's keyword arguments, encodes one id per character."""

    def __init__(self) -> None:
        self.template_kwargs: dict[str, Any] = {}

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        self.template_kwargs = kwargs
        return "".join(m["content"] for m in messages)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_chat_template_kwargs_reach_the_template() -> None:
    config = load_config([], ["--apply-chat-template", "--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    assert config.rollout.apply_chat_template_kwargs == {"enable_thinking": False}
    tokenizer = RecordingTokenizerForTest()
    encode = make_prompt_encoder(tokenizer, apply_chat_template=True,
                                 chat_template_kwargs=config.rollout.apply_chat_template_kwargs)
    assert encode("hi", {}) == [ord("h"), ord("i")]
    assert tokenizer.template_kwargs["enable_thinking"] is False and tokenizer.template_kwargs["add_generation_prompt"]


def test_eval_keys_lengths_and_sampling_from_the_flags(tmp_path: Path, in_repo: Path) -> None:
    eval_file = tmp_path / "eval.jsonl"
    long = " ".join(f"w{i}" for i in range(200))
    eval_file.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in ("short", long)))
    config = load_config([in_repo / "configs" / "tiny_cpu.yaml"], [
        "--run-dir", str(tmp_path), "--eval-prompt-data", "qa", str(eval_file), "--eval-input-key", "question",
        "--eval-label-key", "answer", "--eval-max-prompt-len", "64", "--eval-max-context-len", "100",
        "--eval-min-new-tokens", "2"])

    captured = inspect.getclosurevars(built_loop(config, tmp_path).evaluate).nonlocals
    (name, records), = captured["datasets"]
    assert name == "qa" and [r.prompt for r in records] == ["short"] and records[0].label == "1"  # the long one: out
    assert captured["sampling_params"]["min_new_tokens"] == 2
    assert captured["evaluation"].eval_max_context_len == 100


def test_eval_files_are_checked_with_the_eval_keys_at_submit(tmp_path: Path, in_repo: Path) -> None:
    from hpc_rl.config.validation import collect_problems

    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    flags = ["--eval-prompt-data", "qa", str(eval_file), "--eval-label-key", "answer"]
    wrong = load_config([in_repo / "configs" / "tiny_cpu.yaml"], flags)
    assert any(p.where == "eval.eval_prompt_data[qa]" for p in collect_problems(wrong))
    right = load_config([in_repo / "configs" / "tiny_cpu.yaml"], [*flags, "--eval-input-key", "question"])
    assert not [p for p in collect_problems(right) if p.where.startswith("eval.")]


def test_custom_config_values_reach_the_plugins_args(tmp_path: Path) -> None:
    from hpc_rl.config.plugin_args import plugin_args
    from hpc_rl.config.validation import collect_problems

    extra = tmp_path / "custom.yaml"
    extra.write_text("judge_url: http://judge:8000\nretries: 3\n")
    config = load_config([], ["--custom-config-path", str(extra)])
    args = plugin_args(config)
    assert (args.judge_url, args.retries) == ("http://judge:8000", 3)
    extra.write_text("retries: 3\nrollout_batch_size: 64\n")
    problems = [p for p in collect_problems(load_config([], ["--custom-config-path", str(extra)]), check_files=False)]
    assert any("sets config fields rollout_batch_size" in p.message for p in problems)


EVAL_CONFIG = """
eval:
  defaults:
    n_samples_per_eval_prompt: 4
    temperature: 0.6
    label_key: answer
  datasets:
    - name: qa
      path: {path}
      input_key: question
      max_response_len: 7
    - name: qa_greedy
      path: {path}
      input_key: question
      n_samples_per_eval_prompt: 1
      temperature: 0.0
"""


def test_eval_config_gives_each_dataset_its_own_settings(tmp_path: Path, in_repo: Path) -> None:
    """slime's --eval-config: datasets with defaults and their own sampling and keys; it replaces
    --eval-prompt-data; the controller's eval samples each dataset with its own settings."""
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    config_file = tmp_path / "eval.yaml"
    config_file.write_text(EVAL_CONFIG.format(path=data))
    config = load_config([in_repo / "configs" / "tiny_cpu.yaml"], ["--run-dir", str(tmp_path), "--eval-config",
                                                                   str(config_file)])
    qa, greedy = config.eval.eval_prompt_data
    assert (qa.name, qa.n_samples_per_eval_prompt, qa.temperature, qa.max_response_len) == ("qa", 4, 0.6, 7)
    assert (greedy.n_samples_per_eval_prompt, greedy.temperature, greedy.label_key) == (1, 0.0, "answer")

    captured = inspect.getclosurevars(built_loop(config, tmp_path).evaluate).nonlocals
    settings = captured["per_dataset"]
    assert settings["qa"][0] == 4 and settings["qa"][1]["temperature"] == 0.6
    assert settings["qa"][1]["max_new_tokens"] == 7
    assert settings["qa_greedy"][0] == 1 and settings["qa_greedy"][1]["temperature"] == 0.0
    assert [r.label for r in captured["datasets"][0][1]] == ["1"]  # the datasets' own keys


def test_eval_config_refuses_what_it_cannot_do_per_dataset(tmp_path: Path) -> None:
    from hpc_rl.config import ConfigError

    config_file = tmp_path / "eval.yaml"
    config_file.write_text("eval:\n  datasets:\n    - {name: a, path: /a.jsonl, custom_rm_path: m.f}\n")
    try:
        load_config([], ["--eval-config", str(config_file)])
    except ConfigError as error:
        assert "dataset 'a': custom_rm_path not offered per dataset" in str(error)
    else:
        raise AssertionError("a per-dataset custom reward was accepted")


def test_run_eval_samples_each_dataset_with_its_own_settings() -> None:
    from hpc_rl.data.prompts import PromptRecord
    from hpc_rl.data.samples import Sample
    from hpc_rl.rollout.eval import run_eval
    from tests.unit.test_rollout_scheduler import Harness, encode, run_with

    async def reward(samples: list[Sample]) -> list[float]:
        return [0.0] * len(samples)

    async def body(h: Harness) -> None:
        assert h.client is not None
        records = [PromptRecord(row=i, prompt=f"q{i}", label=None) for i in range(2)]
        metrics = await run_eval(client=h.client, datasets=[("a", records), ("b", records)], encoder=encode,
                                 reward_fn=reward, n_samples=1, sampling_params={"max_new_tokens": 4},
                                 per_dataset={"b": (3, {"max_new_tokens": 2})})
        assert (metrics["eval/a/num_samples"], metrics["eval/a/response_len_mean"]) == (2, 4)
        assert (metrics["eval/b/num_samples"], metrics["eval/b/response_len_mean"]) == (6, 2)

    run_with(body)
