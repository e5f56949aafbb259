"""LoRA's sizes (issue 33): adapter parameters per trainer GPU, bytes per adapter sync, and the memory plan of a
frozen base (no gradients, no optimizer state) that `--dry-run` prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.lora import LoraConfig
from hpc_rl.config.lora_sizes import adapter_sync_bytes, layer_adapter_parameters
from hpc_rl.config.memory_plan import BF16, FP32, GIB, plan_memory, plan_summary
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.parameter_counts import model_share

RECIPE = "configs/qwen3_32b_lora_sft.yaml"


@pytest.fixture(autouse=True)
def _from_repo(in_repo: Path) -> None:
    """Every test here runs from the repository root."""


def test_qwen3_32b_rank_64_sync_is_one_gib_against_61_gib_of_weights() -> None:
    arch = ModelArchitecture.from_yaml("configs/models/qwen3_32B.yaml")
    lora = LoraConfig(lora_rank=64, target_modules="all-linear")
    # per layer r * (in + out): q 5120+8192, k 5120+1024, v 5120+1024, o 8192+5120, gate/up 5120+25600, down 25600+5120
    per_layer = 64 * ((5120 + 8192) * 2 + (5120 + 1024) * 2 + (5120 + 25600) * 3)
    assert adapter_sync_bytes(arch, lora) == per_layer * 64 * BF16 == GIB
    full = model_share(arch).total * BF16
    assert 60 * GIB < full < 62 * GIB  # Qwen3-32B: 32.8B parameters
    attention_only = LoraConfig(lora_rank=64, target_modules="q_proj,k_proj,v_proj,o_proj")
    assert adapter_sync_bytes(arch, attention_only) == 64 * 64 * ((5120 + 8192) * 2 + (5120 + 1024) * 2) * BF16


def test_tp_split_and_shared_a() -> None:
    arch = ModelArchitecture.from_yaml("configs/models/tiny_qwen3.yaml")  # h 64, q 64, kv 32, ffn 128
    canonical = LoraConfig(lora_rank=4, lora_type="canonical_lora", target_modules="all-linear")
    whole = 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert layer_adapter_parameters(arch, canonical, tp=1) == whole
    # TP2: column layers keep A whole and split B; row layers split A and keep B whole
    r = 4
    column = (r * 64 + 64 // 2 * r) + 2 * (r * 64 + 32 // 2 * r) + 2 * (r * 64 + 128 // 2 * r)  # q, k v, gate up
    row = (r * 64 // 2 + 64 * r) + (r * 128 // 2 + 64 * r)  # o, down
    assert layer_adapter_parameters(arch, canonical, tp=2) == column + row == 2944
    shared = LoraConfig(lora_rank=4, lora_type="lora", target_modules="all-linear")
    assert layer_adapter_parameters(arch, shared, tp=1) == whole - 4 * 64 * 2 - 4 * 64  # qkv: 1 A of 3; fc1: 1 of 2


def test_the_lora_recipe_fits_and_full_training_does_not() -> None:
    arch = ModelArchitecture.from_yaml("configs/models/qwen3_32B.yaml")
    lora = plan_memory(load_config([RECIPE]), arch)
    full = plan_memory(load_config([RECIPE], ["--lora-rank", "0", "--target-modules", ""]), arch)
    t = lora.trainer
    assert t.adapter_parameters == layer_adapter_parameters(arch, load_config([RECIPE]).lora, tp=4) * 64
    assert t.grads == t.adapter_parameters * FP32 and t.weights == (t.parameters + t.adapter_parameters) * BF16
    assert t.optimizer_on_gpu == t.adapter_parameters // 2 * 12  # distributed Adam over DP 2
    assert full.trainer.grads == full.trainer.parameters * FP32
    assert lora.problems() == [] and [(p.field, p.code) for p in full.problems()][:1] == [("training", "memory")]
    assert "LoRA r=64 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" in plan_summary(
        load_config([RECIPE]), arch)
    assert "adapter sync sends 1024.0 MiB" in plan_summary(load_config([RECIPE]), arch)
