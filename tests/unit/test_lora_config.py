"""miles' LoRA flags (issue 33): parsed into the `lora` section, target names resolved, each bad value refused at
submit with the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.lora import LoraConfig, adapted_layers, target_projections
from hpc_rl.config.validation import collect_problems

TINY = "configs/tiny_cpu.yaml"
SFT = "configs/tiny_sft_cpu.yaml"


@pytest.fixture(autouse=True)
def _from_repo(in_repo: Path) -> None:
    """Every test here runs from the repository root."""


def problems_for(flags: list[str], config_file: str = SFT) -> str:
    config = load_config([config_file], flags)
    return "\n".join(str(p) for p in collect_problems(config, check_files=True))


def test_miles_flags_fill_the_lora_section() -> None:
    config = load_config([SFT], ["--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.1", "--lora-type",
                                 "canonical_lora", "--target-modules", "all-linear", "--exclude-modules", "o_proj",
                                 "--lora-sync-from-tensor"])
    lora = config.lora
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_dropout, lora.lora_type) == (8, 32, 0.1, "canonical_lora")
    assert lora.lora_sync_from_tensor and lora.scaling == 4.0
    assert target_projections(lora) == ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    assert problems_for(["--lora-rank", "8", "--target-modules", "all-linear"]) == ""


def test_hf_and_megatron_names_mean_the_same_layers() -> None:
    megatron = LoraConfig(lora_rank=4, target_modules="linear_qkv,linear_fc2")
    hf = LoraConfig(lora_rank=4, target_modules="q_proj, k_proj,v_proj,down_proj")
    assert adapted_layers(megatron) == adapted_layers(hf) == {"linear_qkv": ("q_proj", "k_proj", "v_proj"),
                                                              "linear_fc2": ("down_proj",)}
    partial = LoraConfig(lora_rank=4, target_modules="all-linear", exclude_modules="k_proj,linear_fc1")
    assert adapted_layers(partial) == {"linear_qkv": ("q_proj", "v_proj"), "linear_proj": ("o_proj",),
                                       "linear_fc2": ("down_proj",)}


@pytest.mark.parametrize(("flags", "field", "words"), [
    (["--lora-rank", "8"], "lora.target_modules", "is required"),
    (["--lora-rank", "8", "--target-modules", "q_proj,qkv"], "lora.target_modules", "'qkv' is not a module"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--exclude-modules", "linear_qkv"], "lora.exclude_modules",
     "excludes every target"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--lora-type", "dora"], "lora.lora_type", "must be one of"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--lora-alpha", "0"], "lora.lora_alpha", "must be > 0"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--lora-dropout", "1.0"], "lora.lora_dropout", "[0, 1)"),
    (["--lora-rank", "-1"], "lora.lora_rank", "must be >= 0"),
    (["--target-modules", "all-linear"], "lora.target_modules", "lora_rank is 0"),
    (["--lora-train-only"], "lora.lora_train_only", "lora_rank is 0"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--lora-base-cpu-backup"], "lora.lora_base_cpu_backup",
     "--colocate"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--lora-sync-from-tensor", "--lora-train-only"],
     "lora.lora_sync_from_tensor", "contradict"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--lora-adapter-path", "configs"], "lora.lora_adapter_path",
     "adapter_config.json"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--pipeline-model-parallel-size", "2", "--save-hf",
      "out/{rollout_id}"], "checkpoint.save_hf", "one pipeline stage"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--save-hf-merged"], "lora.save_hf_merged", "--save-hf"),
    (["--save-hf-merged"], "lora.save_hf_merged", "lora_rank is 0"),
    (["--lora-rank", "8", "--target-modules", "q_proj", "--only-train-params-name-list", "linear"],
     "training.only_train_params_name_list", "adapters only"),
])
def test_bad_lora_settings_name_the_field_and_the_fix(flags: list[str], field: str, words: str) -> None:
    found = problems_for(flags)
    assert f"{field}:" in found and words in found, found


def test_moe_experts_and_engines_are_refused_with_the_reason() -> None:
    moe = problems_for(["--lora-rank", "8", "--target-modules", "all-linear"], "configs/tiny_moe_cpu.yaml")
    assert "lora.target_modules: gate_proj,up_proj,down_proj on a MoE model" in moe
    attention_only = problems_for(["--lora-rank", "8", "--target-modules", "all-linear", "--exclude-modules",
                                   "gate_proj,up_proj,down_proj"], "configs/tiny_moe_cpu.yaml")
    assert "on a MoE model" not in attention_only
    assert problems_for(["--lora-rank", "8", "--target-modules", "all-linear"], TINY) == ""  # decoupled engines


@pytest.mark.parametrize(("flags", "expected"), [
    (["--lora-sync-from-tensor"], "lora.lora_sync_from_tensor: the adapter goes to /load_lora_adapter_from_tensors "
     "as CUDA IPC handles"),
    (["--lora-train-only"], "lora.lora_train_only: with rollout engines the rollouts would keep sampling"),
    (["--rollout-external-engine-addrs", "127.0.0.1:1"], "rollout.rollout_external_engine_addrs: external engines"),
    (["--async-rollout", "--flush-cache-interval", "2"], "rollout.flush_cache_interval: in-place updates keep"),
])
def test_lora_with_engines_refuses_what_the_adapter_sync_does_not_wire(flags: list[str], expected: str) -> None:
    assert expected in problems_for(["--lora-rank", "8", "--target-modules", "all-linear", *flags], TINY)


@pytest.mark.parametrize("flags", [
    ["--colocate"], ["--colocate", "--lora-sync-from-tensor"], ["--colocate", "--lora-base-cpu-backup"],
])
def test_colocated_lora_and_the_tensor_sync_are_accepted(flags: list[str]) -> None:
    assert problems_for(["--lora-rank", "8", "--target-modules", "all-linear", *flags], TINY) == ""


def test_an_adapter_to_start_from_is_accepted_with_engines(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "adapter_config.json").write_text("{}")
    assert problems_for(["--lora-rank", "8", "--target-modules", "all-linear", "--lora-adapter-path",
                         str(tmp_path)], TINY) == ""
