"""Issue 20: slime's MLA / YaRN / MTP flags read with Megatron-LM's meanings, the config.json checks of every MLA
field (YaRN compared by what it computes), group-limited routing as DeepSeek-V3 scores groups, uneven pipeline
stages, the MTP / speculative-decoding checks, and MLA parameter counts against published totals.

The config.json dicts are built by transformers' own config classes (DeepseekV3Config, Glm4MoeLiteConfig) with
the numbers of slime's scripts/models/*.sh (DeepSeek-V3's YaRN: factor 40 over 4096 positions, mscale 1,
mscale_all_dim 1, as in DeepSeek-V3's published config.json)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.megatron_model import architecture_from_argv
from hpc_rl.config.mtp_checks import mtp_problems, speculative_notes
from hpc_rl.config.problems import Problem
from hpc_rl.models.mla import hf_rotary_numbers, megatron_rotary_numbers
from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.config.parameter_counts import format_count, model_share, mtp_share, stage_shares
from hpc_rl.config.pipeline_split import PipelineSplitError, stage_split, training_split
from hpc_rl.config.sections.training import TrainingConfig
from tests.unit.slime_lines import LINES_DIR, flags_of

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                 "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def slime_model_args(script: str) -> list[str]:
    """scripts/models/<script>.sh's MODEL_ARGS as bash expands it (the test-data file when stored)."""
    return flags_of({"moonlight": "moonlight_model_args.txt",
                     "glm4.7-30B-A3B": "glm4_7_30B_A3B_model_args.txt"}[script])


def deepseek_v3_args() -> list[str]:
    """slime's scripts/models/deepseek-v3.sh MODEL_ARGS (61 layers, the first 3 dense), as bash expands it."""
    text = (LINES_DIR / "deepseek_v3_model_args.txt").read_text()
    return shlex.split(text, comments=True)


def hf_deepseek_v3(**overrides: Any) -> dict[str, Any]:
    from transformers import DeepseekV3Config

    fields = {"rope_parameters": dict(DEEPSEEK_YARN), "max_position_embeddings": 163840, **overrides}
    return DeepseekV3Config(**fields).to_dict()


def hf_glm47_flash(**overrides: Any) -> dict[str, Any]:
    from transformers import Glm4MoeLiteConfig

    config = Glm4MoeLiteConfig(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **overrides)
    out = config.to_dict()
    out["num_nextn_predict_layers"] = 1  # GLM-4.7-Flash's config.json key (Glm4MoeLiteConfig has no MTP field)
    return out


def test_deepseek_v3_flags_resolve_to_megatron_mla_with_yarn_and_match_the_checkpoint() -> None:
    hf = hf_deepseek_v3()
    arch, _ = architecture_from_argv(deepseek_v3_args())
    assert (arch.family, arch.multi_latent_attention, arch.q_lora_rank, arch.kv_lora_rank, arch.qk_head_dim,
            arch.qk_pos_emb_head_dim, arch.v_head_dim) == ("deepseek_v3", True, 1536, 512, 128, 64, 128)
    assert (arch.rotary_scaling_factor, arch.mscale, arch.mscale_all_dim, arch.yarn) == (40.0, 1.0, 1.0, True)
    assert (arch.moe_router_num_groups, arch.moe_router_group_topk, arch.moe_layers()[:4]) == (8, 4, [0, 0, 0, 1])
    assert not arch.add_qkv_bias and arch.mtp_num_layers is None
    assert architecture_mismatches(arch, hf) == []
    with_mtp = dataclasses.replace(arch, mtp_num_layers=1)
    assert architecture_mismatches(with_mtp, hf) == []
    assert any("mtp_num_layers" in p for p in architecture_mismatches(with_mtp, hf_deepseek_v3(num_mtp_layers=0)))


def test_yarn_is_compared_by_what_megatron_and_transformers_compute() -> None:
    arch, _ = architecture_from_argv(deepseek_v3_args())
    ours, theirs = megatron_rotary_numbers(arch), hf_rotary_numbers(hf_deepseek_v3())
    assert ours == pytest.approx(theirs) and ours["softmax_factor"] == pytest.approx((0.1 * 3.6888794541139363 + 1) ** 2)
    wrong = dataclasses.replace(arch, mscale_all_dim=0.707)
    problems = architecture_mismatches(wrong, hf_deepseek_v3())
    assert any("YaRN softmax_factor" in p for p in problems) and any("YaRN cos_sin_factor" in p for p in problems)
    # transformers uses the mscale ratio only when both keys are set: mscale 0.5 alone gives 0.1 ln f + 1
    alone = hf_deepseek_v3(rope_parameters={**DEEPSEEK_YARN, "mscale": 0.5, "mscale_all_dim": 0.0})
    assert hf_rotary_numbers(alone)["cos_sin_factor"] == pytest.approx(0.1 * 3.6888794541139363 + 1)
    assert any("cos_sin_factor" in p for p in architecture_mismatches(dataclasses.replace(arch, mscale=0.5,
                                                                                         mscale_all_dim=0.0), alone))
    beta = hf_deepseek_v3(rope_parameters={**DEEPSEEK_YARN, "beta_fast": 1.0})
    assert any("YaRN beta_fast" in p for p in architecture_mismatches(arch, beta))


def test_yarn_fields_megatron_has_no_flag_for_come_from_config_json() -> None:
    hf = hf_deepseek_v3(rope_parameters={**DEEPSEEK_YARN, "beta_fast": 1.0, "original_max_position_embeddings": 2048})
    arch, _ = architecture_from_argv(deepseek_v3_args(), hf_dir=None)
    assert (arch.beta_fast, arch.original_max_position_embeddings) == (32.0, 4096)  # Megatron's defaults
    from hpc_rl.config.megatron_model import architecture_from_flags
    from hpc_rl.config.settings_sources import MEGATRON_PREFIX, cli_settings_and_problems

    settings, _ = cli_settings_and_problems(deepseek_v3_args())
    flags = {s.path[len(MEGATRON_PREFIX):]: s.value for s in settings if s.path.startswith(MEGATRON_PREFIX)}
    from_checkpoint, problems = architecture_from_flags(flags, hf_config=hf)
    assert problems == [] and from_checkpoint is not None
    assert (from_checkpoint.beta_fast, from_checkpoint.original_max_position_embeddings) == (1.0, 2048)
    assert architecture_mismatches(from_checkpoint, hf) == []


def test_moonlight_and_glm47_flash_flags() -> None:
    moonlight, _ = architecture_from_argv(slime_model_args("moonlight"))
    assert (moonlight.family, moonlight.q_lora_rank, moonlight.yarn, moonlight.moe_router_num_groups) == (
        "deepseek_v3", None, False, 1)
    glm, _ = architecture_from_argv(slime_model_args("glm4.7-30B-A3B"))
    assert (glm.q_lora_rank, glm.qk_head_dim, glm.v_head_dim, glm.add_qkv_bias, glm.moe_layers()[:2]) == (
        768, 192, 256, False, [False, True])  # Megatron's MLA takes no q/k/v bias, whatever --add-qkv-bias says
    hf = hf_glm47_flash()
    as_glm = dataclasses.replace(glm, family="glm4_moe_lite")
    assert architecture_mismatches(as_glm, hf) == []
    with_config, _ = architecture_from_argv(slime_model_args("glm4.7-30B-A3B"), hf_dir=None)
    assert with_config.family == "deepseek_v3"  # the flags alone: the two families share layers and names
    assert any("moe_layer_freq" in p for p in architecture_mismatches(
        as_glm, hf_glm47_flash(mlp_layer_types=["dense", "dense"] + ["sparse"] * 45)))


@pytest.mark.parametrize(("change", "words"), [
    ({"rope_interleave": False}, "rope_interleave is false"),
    ({"q_lora_rank": 1024}, "q_lora_rank: model file says 1536"),
    ({"qk_rope_head_dim": 32}, "qk_pos_emb_head_dim"),
    ({"rope_parameters": {**DEEPSEEK_YARN, "truncate": False}}, "truncate false"),
])
def test_mla_config_json_mismatches_are_named(change: dict[str, Any], words: str) -> None:
    arch, _ = architecture_from_argv(deepseek_v3_args())
    assert any(words in p for p in architecture_mismatches(arch, hf_deepseek_v3(**change)))


@pytest.mark.parametrize(("flags", "words"), [
    (["--kv-lora-rank", "512"], "without --multi-latent-attention"),
    (["--multi-latent-attention", "--rope-type", "rope", "--rotary-scaling-factor", "40", "--num-experts", "4",
      "--qk-layernorm"], "--rope-type rope with --rotary-scaling-factor 40"),
    (["--multi-latent-attention"], "builds MLA for the MoE families"),
    (["--rotary-scaling-factor", "4"], "without --multi-latent-attention"),
])
def test_mla_flag_refusals_name_the_flag(flags: list[str], words: str) -> None:
    base = flags_of("qwen3_4B_model_args.txt")
    with pytest.raises(ConfigError, match=words):
        load_config([], [*base, *flags])


def test_yarn_without_mla_is_refused_in_a_model_file() -> None:
    fields = ModelArchitecture.from_yaml(ROOT / "configs/models/tiny_qwen3.yaml").to_dict()
    with pytest.raises(ValueError, match="YaRN inside MLA only"):
        ModelArchitecture(**{**fields, "rotary_scaling_factor": 4.0})


def test_group_limited_routing_must_score_groups_as_deepseek_v3() -> None:
    arch, _ = architecture_from_argv(deepseek_v3_args())
    assert arch.moe_router_topk // arch.moe_router_group_topk == 2
    with pytest.raises(ValueError, match="by their top 2"):
        dataclasses.replace(arch, moe_router_group_topk=2)  # 8 / 2 = 4 experts per group score
    one_group, _ = architecture_from_argv(slime_model_args("moonlight"))  # --moe-router-num-groups 1: no grouping
    assert architecture_mismatches(one_group, {"model_type": "deepseek_v3", "n_group": 1, "topk_group": 1}) == [
        p for p in architecture_mismatches(one_group, {"model_type": "deepseek_v3"}) if "n_group" not in p]


def test_uneven_pipeline_stages_follow_megatron() -> None:
    assert stage_split(47, 2, last=23).counts == (24, 23)  # slime's GLM-4.7-Flash line
    assert stage_split(61, 4, first=13, last=12).counts == (13, 18, 18, 12)
    assert stage_split(61, 4, first=13, last=12).offsets == (0, 13, 31, 49)
    assert stage_split(8, 2).counts == (4, 4)
    for args, words in (((61, 4, 14, 12), "must split them evenly"), ((47, 2, None, None), "does not divide"),
                        ((4, 1, 2, None), "> 1"), ((4, 3, 0, None), "larger than 0"), ((4, 2, 4, None), "evenly")):
        with pytest.raises(PipelineSplitError, match=words):
            stage_split(*args)
    training = TrainingConfig(pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=23)
    assert training_split(47, training).layers(1) == range(24, 47)


def _config(*flags: str):
    return load_config([], [*flags_of("moonlight_model_args.txt"), "--hf-checkpoint", "/x", *flags])


def test_mtp_and_speculative_decoding_checks() -> None:
    config = _config("--enable-mtp-training", "--rollout-num-gpus-per-engine", "1")
    assert Problem("training.enable_mtp_training", "needs", "trains the MTP layers, but the model has none: add "
                   "--mtp-num-layers (slime asserts the same)") in mtp_problems(config, config.model_args)
    cuda = ["--actor-num-gpus-per-node", "8", "--colocate", "--rollout-num-gpus-per-engine", "8"]
    eagle = _config(*cuda, "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-eagle-topk", "1")
    assert eagle.cluster.device == "cuda"
    found = mtp_problems(eagle, eagle.model_args)
    assert {(p.field, p.code) for p in found} == {("sglang.extra_args.speculative_algorithm", "needs"),
                                                  ("sglang.extra_args.speculative_num_steps", "unsupported")}
    problems = {p.field: p.message for p in found}
    assert "add --mtp-num-layers 1" in problems["sglang.extra_args.speculative_algorithm"]
    assert "asserts they come together" in problems["sglang.extra_args.speculative_num_steps"]
    fine = _config(*cuda, "--mtp-num-layers", "1", "--sglang-speculative-algorithm", "EAGLE",
                   "--sglang-speculative-num-steps", "3", "--sglang-speculative-eagle-topk", "1",
                   "--sglang-speculative-num-draft-tokens", "4")
    assert mtp_problems(fine, fine.model_args) == []
    cpu = load_config([ROOT / "configs/tiny_mla_cpu.yaml"], ["--sglang-speculative-algorithm", "EAGLE"])
    assert "the CPU engine decodes token by token" in speculative_notes(cpu)[0]


def test_parameter_counts_of_mla_models_match_published_totals() -> None:
    deepseek, _ = architecture_from_argv(deepseek_v3_args())
    share = model_share(deepseek)
    assert (format_count(share.total), format_count(share.active)) == ("671.03B", "37.55B")  # published: 671B, 37B
    mtp = mtp_share(dataclasses.replace(deepseek, mtp_num_layers=1))
    embedding_and_head = 2 * 129280 * 7168  # the HF MTP layer's own copies (685B in the HF repo)
    assert format_count(share.total + mtp.total + embedding_and_head) == "684.49B"
    moonlight, _ = architecture_from_argv(slime_model_args("moonlight"))
    assert (format_count(model_share(moonlight).total), format_count(model_share(moonlight).active)) == (
        "15.96B", "2.91B")  # published: 16B total, 3B activated
    glm, _ = architecture_from_argv(slime_model_args("glm4.7-30B-A3B"))
    assert format_count(model_share(glm).total) == "29.94B"  # 30B-A3B
    staged = stage_shares(dataclasses.replace(glm, mtp_num_layers=1), 2, stage_split(47, 2, last=23))
    assert staged[1].total - staged[0].total > 0 and sum(s.total for s in staged) == \
        model_share(dataclasses.replace(glm, mtp_num_layers=1)).total


def test_tiny_deepseek_v3_model_file_flags_and_checkpoint_agree() -> None:
    arch = ModelArchitecture.from_yaml(ROOT / "configs/models/tiny_deepseek_v3.yaml")
    import json

    hf = json.loads((ROOT / "assets/tiny_deepseek_v3/config.json").read_text())
    assert architecture_mismatches(arch, hf) == []
    from_flags, _ = architecture_from_argv(flags_of("tiny_deepseek_v3_model_args.txt"),
                                           hf_dir=str(ROOT / "assets/tiny_deepseek_v3"))
    assert from_flags == arch


def test_gqa_fields_mla_does_not_read_are_not_checked_against_config_json(tmp_path: Path) -> None:
    """Issue 29: slime's tiny DeepSeek-V3 flags over configs/tiny_cpu.yaml (whose tiny Qwen3 model states
    num_query_groups 2) beside a tiny DeepSeek-V3 checkpoint (num_key_value_heads 4) resolve: MLA reads neither
    num_query_groups nor kv_channels. A GQA model is still held to both."""
    from hpc_rl.tiny_model import TinyMlaSpec, make_tiny_mla_model, make_tiny_model

    yarn = {"factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32.0, "beta_slow": 1.0}  # assets/tiny_deepseek_v3's, which the flags state
    mla_dir = make_tiny_mla_model(tmp_path / "tiny_deepseek_v3", TinyMlaSpec(yarn=yarn))
    config = load_config([ROOT / "configs/tiny_cpu.yaml"],
                         ["--hf-checkpoint", str(mla_dir), *flags_of("tiny_deepseek_v3_model_args.txt")])
    from hpc_rl.config.validation import validate

    validate(config)  # what submit runs: the model flags against config.json (num_query_groups 2 vs 4 before)
    from hpc_rl.config.validation import collect_problems

    tp4 = load_config([ROOT / "configs/tiny_cpu.yaml"],
                      ["--hf-checkpoint", str(mla_dir), *flags_of("tiny_deepseek_v3_model_args.txt"),
                       "--tensor-model-parallel-size", "4", "--sequence-parallel", "--actor-num-gpus-per-node", "4"])
    assert tp4.model_args is not None and tp4.model_args.num_query_groups == 2  # inherited, unused by MLA
    assert [str(p) for p in collect_problems(tp4, check_files=False)] == []  # TP 4 splits MLA's 4 heads
    import json

    hf = json.loads((mla_dir / "config.json").read_text())
    arch = ModelArchitecture.from_yaml(ROOT / "configs/models/tiny_deepseek_v3.yaml")
    assert hf["num_key_value_heads"] != 2  # the GQA number the tiny Qwen3 base states differs from config.json's
    stated = architecture_mismatches(dataclasses.replace(arch, num_query_groups=2, kv_channels=8), hf)
    assert stated == architecture_mismatches(arch, hf)
    assert not [line for line in stated if line.startswith(("num_query_groups", "kv_channels"))]
    qwen_dir = make_tiny_model(tmp_path / "tiny_qwen3")
    qwen = ModelArchitecture.from_yaml(ROOT / "configs/models/tiny_qwen3.yaml")
    qwen_hf = json.loads((qwen_dir / "config.json").read_text())
    assert architecture_mismatches(qwen, qwen_hf) == []
    wrong = dataclasses.replace(qwen, num_query_groups=1)
    assert any(line.startswith("num_query_groups:") for line in architecture_mismatches(wrong, qwen_hf))
