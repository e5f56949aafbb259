"""`python -m hpc_rl.submit --dry-run` on every shipped recipe, and exit code 2 on bad configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.submit import main

from tests.unit.recipes import RECIPES, skip_without_family


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_dry_runs(recipe: str, in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    skip_without_family(recipe)
    assert main([f"configs/{recipe}", "--dry-run", "--no-check-files"]) == 0
    out = capsys.readouterr().out
    assert "# resolved config" in out and "job topology" in out
    weight_paths = ("weight-update (NCCL) world size" in out) + ("/update_weights_from_tensor" in out)
    assert weight_paths == (0 if "a trainer-only job: no engines, no router" in out else 1)


def test_colocated_recipe_renders_memory_saver_and_tensor_update(in_repo: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["configs/qwen3_4b_grpo.yaml", "--dry-run", "--no-check-files"]) == 0
    out = capsys.readouterr().out
    engines = [line for line in out.splitlines() if "sglang.launch_server" in line]
    assert len(engines) == 4 and all(line.endswith("--enable-memory-saver") for line in engines)
    assert "no weight-update group" in out and "weight-update (NCCL) world size" not in out


def test_tiny_dry_run_with_every_check(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["configs/tiny_cpu.yaml", "--dry-run"]) == 0
    assert "dry run: the config is valid" in capsys.readouterr().out


def test_invalid_config_exits_2_listing_problems(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["configs/tiny_cpu.yaml", "--dry-run", "--global-batch-size", "7", "--rollout-num-gpus", "0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "problem(s); nothing was submitted" in err and "global_batch_size" in err and "rollout_num_gpus" in err


def test_missing_config_file_exits_2(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["configs/nope.yaml", "--dry-run"]) == 2
    assert "configs/nope.yaml: config file not found" in capsys.readouterr().err


def test_module_entry_point(in_repo: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "hpc_rl.submit", "configs/qwen3_4b_grpo.yaml", "--dry-run",
                             "--no-check-files"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "het group 0 [trainer+rollout]: 1 node(s) x 8 GPU(s)" in result.stdout


def test_help_lists_every_field_with_flag_type_default_and_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_rl.config.help_text import field_rows

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    rows = field_rows()
    assert len(rows) > 100
    for path, flag, kind, default, meaning in rows:
        assert meaning, f"{path} has no docstring in the schema"
        assert f"{flag:<44} {path} ({kind}, default {default})" in text and meaning in text
    assert "--rollout-batch-size" in text and "--swiglu" in text and "--wandb-always-use-train-step: not offered" in text
