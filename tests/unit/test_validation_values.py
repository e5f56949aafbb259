"""Issue 12 item 5 (and item 2's validation part): values, files and data caught before queueing,
every problem in one pass, type errors naming the field, `--dry-run CONFIG`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.validation import collect_problems
from hpc_rl.submit import main
from tests.unit.config_problems import codes, config_problems

TINY = "configs/tiny_cpu.yaml"


@pytest.fixture(autouse=True)
def _from_repo(in_repo: Path) -> None:
    """Every test here runs from the repository root."""


def problems_for(flags: list[str], *, check_files: bool = True) -> str:
    return "\n".join(str(p) for p in collect_problems(load_config([TINY], flags), check_files=check_files))


@pytest.mark.parametrize(("flags", "field", "code", "expected"), [
    (["--rollout-batch-size", "0", "--global-batch-size", "8"], "rollout.rollout_batch_size", "out_of_range",
     "rollout.rollout_batch_size: 0 is out of range: must be >= 1"),
    (["--num-rollout", "-1"], "rollout.num_rollout", "out_of_range", "rollout.num_rollout: -1 is out of range: must be >= 1"),
    (["--lr", "-1"], "optimizer.lr", "out_of_range", "optimizer.lr: -1.0 is out of range: must be > 0"),
    (["--rollout-temperature", "-3"], "rollout.rollout_temperature", "out_of_range",
     "rollout.rollout_temperature: -3.0 must be >= 0"),
    (["--rollout-top-p", "0"], "rollout.rollout_top_p", "out_of_range", "rollout.rollout_top_p: 0.0 must be within (0, 1]"),
    (["--rollout-top-k", "0"], "rollout.rollout_top_k", "out_of_range", "rollout.rollout_top_k: 0 must be -1 (off) or >= 1"),
    (["--eval-top-p", "1.5"], "eval.eval_top_p", "out_of_range", "eval.eval_top_p: 1.5 must be within (0, 1]"),
    (["--expert-model-parallel-size", "2"], "training.expert_model_parallel_size", "unsupported",
     "training.expert_model_parallel_size: 2: the model is dense"),
    (["--max-turns", "3"], "rollout.max_turns", "unused", "rollout.max_turns: is read by a custom generate function only"),
    (["--offload-train"], "training.offload_train", "unused", "this run is not colocated"),
])
def test_bad_values_are_caught(flags: list[str], field: str, code: str, expected: str) -> None:
    assert (field, code) in codes(config_problems([TINY], flags))
    assert expected in problems_for(flags, check_files=False)


def test_hf_checkpoint_without_a_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    text = problems_for(["--hf-checkpoint", str(tmp_path)])
    assert f"{tmp_path} is not a HuggingFace model directory: no weights" in text and "no a tokenizer" not in text.replace(
        "no a tokenizer (", "X")


def test_hf_checkpoint_complete_passes(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree("assets/tiny_qwen3", model)
    assert "hf_checkpoint" not in problems_for(["--hf-checkpoint", str(model)])


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_whole_prompt_file_is_checked(tmp_path: Path) -> None:
    good = json.dumps({"prompt": "p", "label": "1"})
    rows = [good] * 40 + ["{not json", json.dumps({"prompt": "p"}), good, json.dumps({"prompt": ""})[:-1] + ', "label": 2}']
    data = write_lines(tmp_path / "d.jsonl", rows)
    text = problems_for(["--prompt-data", str(data)])
    assert "2 bad row(s) of 44 (whole file checked)" in text
    assert f"{data}:41: not valid JSON" in text and f"{data}:42: missing label key 'label'" in text
    assert "rollout.prompt_data" not in problems_for(["--prompt-data", str(data), "--skip-bad-lines"])


def test_empty_prompt_file(tmp_path: Path) -> None:
    data = write_lines(tmp_path / "empty.jsonl", [])
    assert f"{data} has no usable prompt (the file is empty)" in problems_for(["--prompt-data", str(data)])


def test_two_unknown_keys_and_two_type_errors_all_reported(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.yaml", ["rollout_batch_sise: 3", "lrr: 1", "global_batch_size: many",
                                              "rollout:", "  n_samples_per_prompt: lots"])
    with pytest.raises(ConfigError) as caught:
        load_config([path], ["--seed", "x"])
    text = str(caught.value)
    assert {(p.field, p.code, p.location) for p in caught.value.problems} == {
        ("training.global_batch_size", "bad_type", f"{path}:3"), ("rollout.n_samples_per_prompt", "bad_type", f"{path}:5"),
        ("training.seed", "bad_type", "command line --seed")}
    assert f"{path}:1: unknown setting 'rollout_batch_sise'" in text and f"{path}:2: unknown setting 'lrr'" in text
    assert f"{path}:3: training.global_batch_size: 'many' is not an integer" in text
    assert f"{path}:5: rollout.n_samples_per_prompt: 'lots' is not an integer" in text
    assert "command line --seed: training.seed: 'x' is not an integer" in text


def test_submit_lists_every_problem_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([TINY, "--dry-run", "--lrr", "1", "--seed", "x"]) == 2
    err = capsys.readouterr().err
    assert "the config has 2 problem(s)" in err and "'lrr'" in err and "training.seed" in err


def test_flag_before_the_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run", TINY]) == 0
    assert main(["--no-check-files", "--dry-run", TINY, "--executor", "local"]) == 0
    assert "dry run: the config is valid" in capsys.readouterr().out
