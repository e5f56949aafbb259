"""Issue 19: slime's MoE model flags read with Megatron's meanings, the MoE families, and the HF config.json
check of every MoE key (real published config.json files in tests/unit/data/hf_configs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.config.validation import collect_problems
from hpc_rl.config.moe_layer_freq import LayerFreqError, expand_layer_freq, parse_layer_freq
from tests.unit.slime_lines import flags_of

HF_CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"
QWEN3_30B = flags_of("qwen3_30B_A3B_model_args.txt")
GLM45_AIR = flags_of("glm4_5_106B_A12B_model_args.txt")
GLM45 = flags_of("glm4_5_355B_A32B_model_args.txt")


def hf_config(name: str) -> dict[str, Any]:
    return json.loads((HF_CONFIGS / f"{name}.json").read_text())


def arch_of(flags: list[str]) -> ModelArchitecture:
    arch = load_config([], flags).model_args
    assert arch is not None
    return arch


@pytest.mark.parametrize(("value", "layers", "expected"), [
    (1, 4, [1, 1, 1, 1]),
    ("2", 5, [1, 0, 1, 0, 1]),  # Megatron: layer i is MoE when i % N == 0
    ("[0]*1+[1]*3", 4, [0, 1, 1, 1]),
    ("[0, 1, 1, 1]", 4, [0, 1, 1, 1]),
    ("([1]*2+[0]*1)*2", 6, [1, 1, 0, 1, 1, 0]),
    ([0, 0, 1], 3, [0, 0, 1]),
])
def test_layer_freq_spellings(value: Any, layers: int, expected: list[int]) -> None:
    assert expand_layer_freq(value, layers) == expected


@pytest.mark.parametrize("value", ["__import__('os').system('true')", "[2]*3", "[0]+1", "0", "[0]*1+[1]*", True,
                                   "[0.5]*2"])
def test_layer_freq_refuses_what_is_not_a_pattern(value: Any) -> None:
    with pytest.raises(LayerFreqError):
        parse_layer_freq(value)


def test_layer_freq_length_must_match_the_layers() -> None:
    with pytest.raises(LayerFreqError, match="3 entries for 4 layers"):
        expand_layer_freq("[1]*3", 4)
    with pytest.raises(ConfigError, match="moe_layer_freq: 45 entries for 46 layers"):
        load_config([], [*GLM45_AIR, "--moe-layer-freq", "[1]*45"])


def test_layer_freq_bash_split_list_is_one_value() -> None:
    """An unquoted `--moe-layer-freq [0, 1, 1]` reaches argv as three tokens; Megatron's own spelling has no spaces."""
    base = [*QWEN3_30B, "--num-layers", "3"]
    assert arch_of([*base, "--moe-layer-freq", "[0,", "1,", "1]"]).moe_layer_freq == [0, 1, 1]
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        load_config([], [*base, "--moe-layer-freq", "[0]*x"])


def test_qwen3_30b_flags_are_qwen3_moe_with_megatron_meanings() -> None:
    arch = arch_of(QWEN3_30B)
    assert (arch.family, arch.num_moe_experts, arch.moe_ffn_hidden_size, arch.moe_router_topk) == (
        "qwen3_moe", 128, 768, 8)
    assert arch.moe_layers() == [True] * 48
    assert (arch.moe_router_score_function, arch.moe_router_pre_softmax, arch.moe_shared_expert_intermediate_size,
            arch.moe_router_enable_expert_bias) == ("softmax", False, None, False)
    assert architecture_mismatches(arch, hf_config("qwen3_30b_a3b")) == []


@pytest.mark.parametrize(("flags", "hf", "dense_layers", "scaling", "qk_norm"), [
    (GLM45_AIR, "glm4_5_air", [0], None, False),
    (GLM45, "glm4_5", [0, 1, 2], 2.5, True),
])
def test_glm45_flags_are_glm4_moe(flags: list[str], hf: str, dense_layers: list[int], scaling: float | None,
                                  qk_norm: bool) -> None:
    arch = arch_of(flags)
    assert arch.family == "glm4_moe"
    assert [layer for layer, moe in enumerate(arch.moe_layers()) if not moe] == dense_layers
    assert (arch.moe_router_score_function, arch.moe_router_enable_expert_bias, arch.moe_router_topk_scaling_factor,
            arch.qk_layernorm, arch.rotary_percent, arch.add_qkv_bias) == ("sigmoid", True, scaling, qk_norm, 0.5, True)
    assert arch.moe_shared_expert_intermediate_size == arch.moe_ffn_hidden_size
    assert architecture_mismatches(arch, hf_config(hf)) == []


def test_model_files_match_the_published_configs(in_repo: Path) -> None:
    for model_file, hf in (("qwen3_30B_A3B", "qwen3_30b_a3b"), ("glm4_5_air", "glm4_5_air"), ("qwen3_4B", "qwen3_4b")):
        arch = ModelArchitecture.from_yaml(f"configs/models/{model_file}.yaml")
        assert architecture_mismatches(arch, hf_config(hf)) == [], model_file
    assert ModelArchitecture.from_yaml("configs/models/glm4_5_air.yaml") == arch_of(GLM45_AIR).__class__(
        **{**arch_of(GLM45_AIR).to_dict(), "max_position_embeddings": 131072})


@pytest.mark.parametrize(("hf", "change", "expected"), [
    ("qwen3_30b_a3b", {"num_experts": 64}, "num_moe_experts: model file says 128"),
    ("qwen3_30b_a3b", {"moe_intermediate_size": 512}, "moe_ffn_hidden_size: model file says 768"),
    ("qwen3_30b_a3b", {"num_experts_per_tok": 4}, "moe_router_topk: model file says 8"),
    ("qwen3_30b_a3b", {"norm_topk_prob": False}, "moe_router_pre_softmax: model file says False"),
    ("qwen3_30b_a3b", {"mlp_only_layers": [0]}, "moe_layer_freq: the model file's dense-MLP layers are [], "),
    ("qwen3_30b_a3b", {"decoder_sparse_step": 2}, "config.json's (first_k_dense_replace / mlp_only_layers"),
    ("qwen3_30b_a3b", {"attention_bias": True}, "add_qkv_bias: the model file's q/k/v projections lack a bias"),
    ("qwen3_30b_a3b", {"model_type": "glm4_moe"}, "moe_router_score_function: model file says 'softmax'"),
    ("glm4_5_air", {"first_k_dense_replace": 3}, "are [0], config.json's (first_k_dense_replace"),
    ("glm4_5_air", {"n_shared_experts": 2}, "moe_shared_expert_intermediate_size: model file says 1408, config.json "
                                            "says 2816"),
    ("glm4_5_air", {"routed_scaling_factor": 2.5}, "moe_router_topk_scaling_factor: model file says None"),
    ("glm4_5_air", {"use_qk_norm": True}, "qk_layernorm: model file says False"),
    ("glm4_5_air", {"partial_rotary_factor": 1.0}, "rotary_percent: model file says 0.5"),
    ("glm4_5_air", {"n_group": 8, "topk_group": 4}, "config.json's n_group/topk_group say (8, 4)"),
    ("glm4_5_air", {"norm_topk_prob": False}, "Megatron always renormalises the chosen sigmoid scores"),
    ("glm4_5_air", {"scoring_func": "softmax"}, "config.json (glm4_moe) routes with 'softmax'"),
    ("glm4_5_air", {"model_type": "qwen3_moe", "first_k_dense_replace": 1},
     "moe_router_enable_expert_bias: model file says True, config.json (qwen3_moe) has no e_score_correction_bias"),
])
def test_every_moe_key_is_checked(hf: str, change: dict[str, Any], expected: str) -> None:
    arch = arch_of(QWEN3_30B if hf.startswith("qwen") else GLM45_AIR)
    assert architecture_mismatches(arch, hf_config(hf)) == []
    mismatches = architecture_mismatches(arch, {**hf_config(hf), **change})
    assert any(expected in line for line in mismatches), mismatches


def test_dense_file_against_moe_checkpoint_and_back(in_repo: Path) -> None:
    dense = ModelArchitecture.from_yaml("configs/models/qwen3_4B.yaml")
    assert any("the model file is dense, config.json (qwen3_moe) has 128 experts" in line
               for line in architecture_mismatches(dense, hf_config("qwen3_30b_a3b")))
    moe = arch_of(QWEN3_30B)
    assert any("config.json (qwen3) has no experts" in line
               for line in architecture_mismatches(moe, hf_config("qwen3_4b")))


def test_family_from_config_json_model_type(tmp_path: Path) -> None:
    """config.json's model_type names the family; the architecture check then reports every field that differs."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config("glm4_5_air")))
    config = load_config([], [*QWEN3_30B, "--hf-checkpoint", str(tmp_path)])
    assert config.model_args is not None and config.model_args.family == "glm4_moe"
    problems = [str(p) for p in collect_problems(config, check_files=False)]
    assert any("moe_router_score_function: model file says 'softmax', config.json (glm4_moe) routes with 'sigmoid'"
               in p for p in problems), problems
    (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen3_4b")))
    with pytest.raises(ConfigError, match="describe a qwen3_moe model but config.json says model_type 'qwen3'"):
        load_config([], [*QWEN3_30B, "--hf-checkpoint", str(tmp_path)])


@pytest.mark.parametrize(("extra", "reason"), [
    (["--moe-router-score-function", "sigmoid"], "describe neither Qwen3-MoE"),
    (["--spec", "slime_plugins.models.glm4", "get_glm_spec"], "--spec with --num-experts"),
])
def test_moe_flags_outside_the_families_are_refused(extra: list[str], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        load_config([], [*QWEN3_30B, *extra])


def test_moe_flags_on_a_model_file(in_repo: Path) -> None:
    """--num-experts on top of a dense model file makes it an MoE model of its family, Megatron's defaults filled in."""
    arch = arch_of(["--model", "configs/models/qwen3_4B.yaml", "--num-experts", "16", "--moe-router-topk", "2"])
    assert (arch.family, arch.num_moe_experts, arch.moe_ffn_hidden_size) == ("qwen3_moe", 16, 9728)
    moe_file = arch_of(["--model", "configs/models/qwen3_30B_A3B.yaml", "--moe-router-topk", "4"])
    assert (moe_file.family, moe_file.moe_router_topk, moe_file.num_moe_experts) == ("qwen3_moe", 4, 128)


def test_megatron_optimizer_config_takes_the_offload_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU optimizer's config is Megatron's own OptimizerConfig, built here on CPU, so a wrong field name fails
    this test. With offload Megatron skips its FusedAdam import; only its Transformer Engine version probe needs a
    fake (TE is not installed here)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import optimizer_config

    def fake_te_version_at_least(version: str, check_equality: bool = True) -> bool:
        return True

    monkeypatch.setattr(optimizer_config, "is_te_min_version", fake_te_version_at_least)

    from hpc_rl.training.optimizer import megatron_optimizer_fields

    config = load_config([], ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
                              "--use-precision-aware-optimizer"]).optimizer
    megatron = MegatronOptimizerConfig(**megatron_optimizer_fields(config, params_dtype=torch.bfloat16,
                                                                   distributed=True))
    assert (megatron.optimizer_cpu_offload, megatron.optimizer_offload_fraction, megatron.overlap_cpu_optimizer_d2h_h2d,
            megatron.use_precision_aware_optimizer) == (True, 1.0, True, True)
    plain = megatron_optimizer_fields(load_config([], []).optimizer, params_dtype=torch.bfloat16, distributed=True)
    assert (plain["optimizer_cpu_offload"], plain["optimizer_offload_fraction"]) == (False, 0.0)
