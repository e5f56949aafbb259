"""The memory plan (`--dry-run`) on the hybrid linear-attention families: parameters counted as Megatron builds the
Gated DeltaNet layers (not as GQA attention), the full-attention layers' output gate and the gated shared expert;
the engine's KV cache per token over the full-attention layers only, with each running request's linear-attention
state (conv window + SSM state) beside it; activations of a linear layer as its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hpc_rl.config import load_config
from hpc_rl.config.memory_plan import _layer_activation_elements, engine_memory, plan_memory
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.model_checks import run_architecture
from hpc_rl.config.parameter_counts import model_share
from hpc_rl.models.qwen3_next.tiny import make_tiny
from tests.unit.slime_lines import seed_argv

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_the_count_equals_the_tiny_checkpoints_tensors(family: str, tmp_path: Path) -> None:
    hf_dir = make_tiny(tmp_path, family=family)
    on_disk = sum(tensor.numel() for tensor in load_file(str(hf_dir / "model.safetensors")).values())
    arch = ModelArchitecture.from_yaml(ROOT / "configs" / "models" / f"tiny_{family}.yaml")
    assert model_share(arch).total == on_disk


def test_qwen3_next_80b_engine_kv_counts_full_attention_layers_and_a_state_per_request(capsys) -> None:
    config = load_config([], seed_argv("qwen3_next_80b_a3b_colocated_8") + ["--hf-checkpoint", "/nonexistent/q"])
    arch = run_architecture(config)
    assert arch is not None and sum(arch.linear_attention_freq) == 36
    share = model_share(arch)
    assert 79.6e9 < share.total < 79.8e9  # + the MTP layer hpc_rl does not build: HF's 81B
    engine = engine_memory(config, arch, 141 * 2**30)
    kv_heads = max(1, arch.num_query_groups // engine.attention_tp)
    assert engine.kv_bytes_per_token == 12 * 2 * kv_heads * arch.kv_channels * 2  # 12 full-attention layers, bf16
    conv = (2 * 16 * 128 + 32 * 128) * 3 * 2  # q, k, v channels x (kernel 4 - 1), bf16
    ssm = 32 * 128 * 128 * 4  # value heads x k_dim x v_dim, fp32
    assert engine.linear_state_bytes_per_request == 36 * (conv + ssm) // engine.attention_tp
    assert "linear-attention state" in plan_memory(config, arch).describe()


def test_a_linear_layers_activations_are_its_own() -> None:
    arch = ModelArchitecture.from_yaml(ROOT / "configs" / "models" / "tiny_qwen3_next.yaml")
    gated = _layer_activation_elements(arch, moe=True)
    plain = _layer_activation_elements(dataclasses.replace(arch, attention_output_gate=False), moe=True)
    assert gated - plain == 2 * arch.num_attention_heads * arch.kv_channels  # the gate and the gated output
    linear = _layer_activation_elements(arch, moe=True, linear=True)
    qk, v, heads = 2 * 16, 4 * 16, 4
    assert linear - gated == (2 * 64 + (2 * qk + 2 * v + 2 * heads) + (2 * qk + v) + 2 * qk + 2 * v) - (
        2 * 64 + (4 * 16 + 2 * 2 * 16) + (4 * 16 + 2 * 16) + 4 * 16 + 2 * 4 * 16)
