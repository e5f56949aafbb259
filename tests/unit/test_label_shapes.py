"""Labels a reward cannot score are refused at submit (issue 37 case 5): a list or null `label` under deepscaler,
math or dapo ran every rollout at reward 0.000 and ended "run finished". The refusal names the file, the line
and the field, before anything is written or queued; a custom reward reads labels its own way and is left alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.validation import collect_problems
from hpc_rl.data.label_shapes import LABEL_SHAPES, label_problem
from hpc_rl.rewards.scoring import RM_TYPES

TINY = "configs/tiny_cpu.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _from_repo(in_repo: Path) -> None:
    """Every test here runs from the repository root."""


def test_every_reward_type_has_a_label_shape() -> None:
    assert set(LABEL_SHAPES) == set(RM_TYPES)


@pytest.mark.parametrize("rm_type", ["deepscaler", "math", "dapo", "boxed_math", "tiny_task"])
@pytest.mark.parametrize("label", [["42"], None, {"answer": "42"}, True, "", "  "])
def test_labels_a_math_reward_cannot_score(rm_type: str, label: object) -> None:
    assert label_problem(rm_type, label) is not None


@pytest.mark.parametrize("rm_type", ["deepscaler", "math", "dapo", "tiny_task"])
@pytest.mark.parametrize("label", ["42", 42, 4.5, "\\boxed{x^2}"])
def test_labels_a_math_reward_scores(rm_type: str, label: object) -> None:
    assert label_problem(rm_type, label) is None


def test_f1_needs_text_and_remote_rm_takes_anything() -> None:
    assert "string label" in label_problem("f1", 3)
    assert label_problem("f1", "an answer") is None
    assert label_problem("remote_rm", ["anything", None]) is None


def write_prompts(path: Path, labels: list[object], extra: dict | None = None) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"question {i}", "label": label, **(extra or {})}) + "\n"
                            for i, label in enumerate(labels)))
    return path


def problems(prompts: Path, *flags: str) -> str:
    config = load_config([TINY], ["--prompt-data", str(prompts), *flags])
    return "\n".join(str(p) for p in collect_problems(config, check_files=True))


def test_a_list_label_under_deepscaler_is_refused_naming_file_line_and_field(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "lists.jsonl", ["7", ["7", "seven"], None, "8"])
    text = problems(prompts, "--rm-type", "deepscaler")
    assert "rollout.prompt_data" in text
    assert f"{prompts}:2: field 'label' is a list (['7', 'seven']); rm_type deepscaler" in text
    assert f"{prompts}:3: field 'label' is null" in text
    assert "2 label(s) the reward cannot score" in text and "custom_rm_path" in text


def test_skip_bad_lines_does_not_let_unscorable_labels_through(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "lists.jsonl", [["1"], ["2"]])
    assert "field 'label' is a list" in problems(prompts, "--rm-type", "math", "--set", "rollout.skip_bad_lines=true")


def test_a_row_s_own_rm_type_is_the_one_checked(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "f1.jsonl", [3, 4], extra={"metadata": {"rm_type": "f1"}})
    text = problems(prompts, "--rm-type", "math", "--set", "rollout.metadata_key=metadata")
    assert "field 'label' is a int (3); rm_type f1 compares text" in text


def test_good_labels_and_custom_rewards_pass(tmp_path: Path) -> None:
    assert "label" not in problems(write_prompts(tmp_path / "ok.jsonl", ["1", 2, 3.5]), "--rm-type", "dapo")
    lists = write_prompts(tmp_path / "lists.jsonl", [["1"], ["2"]])
    assert "cannot score" not in problems(lists, "--rm-type", "math", "--set",
                                          "rollout.custom_rm_path=tests/integration/plugins/hanging_reward.py:reward")


def test_submit_refuses_before_writing_anything(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "lists.jsonl", [["1"], ["2"]])
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "hpc_rl.submit", TINY, "--executor", "local", "--run-dir",
                             str(run_dir), "--prompt-data", str(prompts), "--rm-type", "deepscaler"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{prompts}:1: field 'label' is a list" in result.stderr + result.stdout
    assert not (run_dir / "config.resolved.yaml").exists()
