"""The hybrid linear-attention families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE / Qwen3.6) as configuration and names:
slime's model scripts read into architectures, config.json checked against them, context parallelism refused with
the reason, slime's --qwen-gdn-backend, and the HF <-> Megatron layouts round-tripping every tensor of each tiny
checkpoint bit for bit, at TP1 and through TP2 shards (Megatron's own forward: tests/integration/test_hybrid_models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_rl.config.megatron_model import architecture_from_argv
from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.config.typing_rules import ConfigError
from hpc_rl.models.qwen3_next.config_rules import layout_problems, transformer_config_fields
from hpc_rl.weights import hf_mapping
from tests.unit.slime_lines import flags_of

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
TINY_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
              "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--vocab-size", "24",
              "--qk-layernorm", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6",
              "--rotary-base", "1000000", "--rotary-percent", "0.25", "--max-position-embeddings", "512",
              "--use-gated-attention", "--apply-layernorm-1p"]
TINY_MOE_FLAGS = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
                  "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
SPEC = {"qwen3_next": ["--spec", "slime_plugins.models.qwen3_next", "get_qwen3_next_spec"],
        "qwen3_5": ["--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec"],
        "qwen3_5_moe": ["--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hpc_rl.tiny_model import main

    root = tmp_path_factory.mktemp("tiny_hybrid")
    for family in FAMILIES:  # the CLI (tools/make_tiny_model.py) with the hybrid families' makers
        main([str(root / family), "--family", family, "--num-layers", "4"])
    return {family: root / family for family in FAMILIES}


def model_file(family: str) -> ModelArchitecture:
    return ModelArchitecture.from_yaml(ROOT / "configs" / "models" / f"tiny_{family}.yaml")


@pytest.mark.parametrize(("args_file", "family", "moe"), [
    ("qwen3_5_0.8B_model_args.txt", "qwen3_5", False),
    ("qwen3_5_35B_A3B_model_args.txt", "qwen3_5_moe", True),
    ("qwen3_next_80B_A3B_model_args.txt", "qwen3_next", True),
])
def test_slimes_model_scripts_become_hybrid_architectures(args_file: str, family: str, moe: bool) -> None:
    arch, _ = architecture_from_argv(flags_of(args_file))  # no config.json: transformers' defaults stand in
    assert arch.family == family and arch.is_moe == moe
    assert arch.layernorm_zero_centered_gamma and arch.attention_output_gate and arch.rotary_percent == 0.25
    assert arch.moe_shared_expert_gate == moe
    assert arch.linear_attention_freq == [0 if (layer + 1) % 4 == 0 else 1 for layer in range(arch.num_layers)]
    assert (arch.linear_num_key_heads, arch.linear_num_value_heads, arch.linear_key_head_dim) == (16, 32, 128)


@pytest.mark.parametrize("family", FAMILIES)
def test_flags_with_the_checkpoint_read_its_layer_pattern_and_equal_the_model_file(tiny: dict[str, Path],
                                                                                  family: str) -> None:
    flags = [*SPEC[family], *TINY_FLAGS, *(TINY_MOE_FLAGS if family != "qwen3_5" else [])]
    arch, _ = architecture_from_argv(flags, hf_dir=str(tiny[family]))
    assert arch == model_file(family)
    assert architecture_mismatches(arch, json.loads((tiny[family] / "config.json").read_text())) == []
    with pytest.raises(ValueError, match="layer_types has 4 layers, --num-layers says 8"):
        architecture_from_argv([*flags, "--num-layers", "8"], hf_dir=str(tiny[family]))
    explicit, _ = architecture_from_argv([*flags, "--linear-attention-freq", "2"], hf_dir=str(tiny[family]))
    assert explicit.linear_attention_freq == [1, 0, 1, 0]  # a flag wins over config.json (the check then differs)


def test_config_json_disagreeing_with_the_model_file_is_named(tiny: dict[str, Path]) -> None:
    hf = json.loads((tiny["qwen3_next"] / "config.json").read_text())
    hf.update(layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=8)
    problems = architecture_mismatches(model_file("qwen3_next"), hf)
    assert any(p.startswith("linear_attention_freq: model file says [1, 1, 1, 0]") for p in problems), problems
    assert any(p.startswith("linear_num_value_heads: model file says 4") for p in problems), problems
    vlm = {"model_type": "qwen3_5", "text_config": json.loads((tiny["qwen3_5"] / "config.json").read_text())}
    assert architecture_mismatches(model_file("qwen3_5"), vlm) == []  # the release's nested text config


def test_gated_attention_without_a_hybrid_family_and_bad_patterns_are_refused() -> None:
    with pytest.raises(ValueError, match="--use-gated-attention: gated attention.*get_qwen3_5_spec"):
        architecture_from_argv([*TINY_FLAGS[:-1]])
    fields = {**model_file("qwen3_5").to_dict(), "linear_attention_freq": [1, 1, 0]}
    with pytest.raises(ValueError, match="linear_attention_freq: .*one 0 \\(full\\) or 1 \\(linear\\) per layer"):
        ModelArchitecture(**fields)
    with pytest.raises(ValueError, match="Gated DeltaNet layers are built for the families"):
        ModelArchitecture(**{**model_file("qwen3_5").to_dict(), "family": "qwen3"})
    with pytest.raises(ValueError, match="set linear_attention_freq"):
        ModelArchitecture(**{**model_file("qwen3_5").to_dict(), "linear_attention_freq": None})


def test_context_parallelism_over_linear_attention_is_refused_with_the_reason() -> None:
    arch = model_file("qwen3_next")
    problems = dict(layout_problems(arch, tp=4, cp=2))
    assert "carries its state along the whole sequence" in problems["training.context_parallel_size"]
    assert "TP 4 does not divide the model's 2 linear_num_key_heads" in problems["training.tensor_model_parallel_size"]
    with pytest.raises(ValueError, match="context parallelism splits the sequence"):
        transformer_config_fields(arch, context_parallel_size=2)
    assert transformer_config_fields(arch)["linear_attention_freq"] == [1, 1, 1, 0]
    assert layout_problems(ModelArchitecture.from_yaml(ROOT / "configs/models/tiny_qwen3.yaml"), tp=1, cp=2) == []


def test_qwen_gdn_backend_fla_is_what_hpc_rl_runs() -> None:
    from hpc_rl.config.loading import load_config

    tiny_qwen3 = ["--model", "configs/models/tiny_qwen3.yaml"]
    load_config([], [*tiny_qwen3, "--qwen-gdn-backend", "fla"])
    with pytest.raises(ConfigError, match="FlashQLA is not offered"):
        load_config([], [*tiny_qwen3, "--qwen-gdn-backend", "flashqla"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_round_trips_bit_exact_at_tp1_and_through_tp2_shards(tiny: dict[str, Path], family: str) -> None:
    arch = model_file(family)
    tensors = load_file(str(tiny[family] / "model.safetensors"))
    rows = hf_mapping.name_map(arch)
    assert sorted(name for _, names in rows for name in names) == sorted(tensors)
    for megatron_name, hf_names in rows:
        full = hf_mapping.to_megatron(megatron_name, [tensors[n] for n in hf_names], arch)
        shards = [hf_mapping.shard(megatron_name, full, rank, 2, arch) for rank in range(2)]
        back = hf_mapping.to_hf(megatron_name, hf_mapping.unshard(megatron_name, shards, arch), arch)
        assert [name for name, _ in back] == hf_names
        for name, tensor in back:
            assert torch.equal(tensor, tensors[name]), name


def test_megatron_rows_follow_the_gdn_and_gate_layouts(tiny: dict[str, Path]) -> None:
    arch = model_file("qwen3_next")
    tensors = load_file(str(tiny["qwen3_next"] / "model.safetensors"))
    layer = "model.layers.0.linear_attn."
    fused = [tensors[layer + "in_proj_qkvz.weight"], tensors[layer + "in_proj_ba.weight"]]
    in_proj = hf_mapping.to_megatron("decoder.layers.0.self_attention.in_proj.weight", fused, arch)
    # key head 1's query rows (16..31 of q) are rows 48..63 of in_proj_qkvz (per key head: q, k, v and z of 2 v heads)
    assert torch.equal(in_proj[16:32], tensors[layer + "in_proj_qkvz.weight"][96:112])
    assert torch.equal(in_proj[-4:], tensors[layer + "in_proj_ba.weight"][[2, 3, 6, 7]])  # alpha of v heads 0..3
    shard = hf_mapping.shard("decoder.layers.0.self_attention.in_proj.weight", in_proj, 1, 2, arch)
    assert torch.equal(shard[:16], in_proj[16:32])  # TP rank 1: key head 1's queries first
    qkv = hf_mapping.to_megatron("decoder.layers.3.self_attention.linear_qkv.weight",
                                 [tensors[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv"], arch)
    q_proj = tensors["model.layers.3.self_attn.q_proj.weight"]
    # group 0: the queries of heads 0 and 1, then their gates (HF: per head [q_h | gate_h] of 16 rows each)
    assert torch.equal(qkv[16:32], q_proj[32:48]) and torch.equal(qkv[32:48], q_proj[16:32])
