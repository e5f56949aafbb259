"""Issue 20: slime's Moonlight-16B-A3B and GLM-4.7-Flash launch lines (tests/unit/data/slime_launch_lines, verbatim at
THUDM/slime 624b824a) resolve every MLA, YaRN, MTP, uneven-pipeline and speculative-decoding number, dry-run with
their layout and memory plan, and the YAML recipes hold the same numbers."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.memory_plan import plan_summary
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.validation import collect_problems
from hpc_rl.submit import main
from tests.unit.slime_lines import config_field, flags_of
from tests.unit.test_slime_moe_lines import resolved_from_dry_run

HEAD = shlex.split("--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate")
MOONLIGHT_LINE = [*HEAD, *flags_of("moonlight_model_args.txt"), *flags_of("moonlight_16B_A3B_rest.txt")]
GLM47_FLASH_LINE = [*HEAD, *flags_of("glm4_7_30B_A3B_model_args.txt"), *flags_of("glm4_7_30B_A3B_rest.txt")]


def test_moonlight_line_dry_runs_verbatim(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*MOONLIGHT_LINE, "--dry-run", "--no-check-files", "--executor", "local"])
    out, err = capsys.readouterr()
    assert code == 0, err
    resolved = resolved_from_dry_run(out)
    arch, training = resolved["model_args"], resolved["training"]
    assert (arch["family"], arch["multi_latent_attention"], arch["q_lora_rank"], arch["kv_lora_rank"],
            arch["qk_head_dim"], arch["qk_pos_emb_head_dim"], arch["v_head_dim"], arch["rotary_scaling_factor"],
            arch["rotary_base"]) == ("deepseek_v3", True, None, 512, 128, 64, 128, 1.0, 50000.0)
    assert (arch["moe_router_num_groups"], arch["moe_router_group_topk"], arch["moe_router_topk_scaling_factor"],
            arch["moe_shared_expert_intermediate_size"]) == (1, 1, 2.446, 2816)
    assert (training["tensor_model_parallel_size"], training["expert_model_parallel_size"],
            training["num_steps_per_rollout"], training["moe_token_dispatcher_type"]) == (4, 8, 4, "flex")
    assert "TP 4 x PP 1 x CP 1 x DP 2 = 8" in out and "ETP 1 x EP 8 x expert-DP 1 = 8; 64 experts, 8 per EP rank" in out
    assert "15.96B parameters, 2.91B active per token" in out
    assert "KV cache 51.9 GiB = 1793240 tokens" in out  # 27 layers x (512 + 64) bf16 latents per token
    assert "DOES NOT FIT" not in out and "dry run: the config is valid" in out


def test_glm47_flash_line_resolves_and_only_megatrons_expert_groups_refuse_it(in_repo: Path) -> None:
    """Every number of run-glm4.7-30B-A3B.sh resolves; Megatron-core refuses its EP 8 on 8 GPUs with PP 2
    (expert groups live inside a pipeline stage: ETP x EP x PP must divide the world)."""
    config = load_config([], GLM47_FLASH_LINE)
    arch = config.model_args
    assert arch is not None
    assert (arch.q_lora_rank, arch.qk_head_dim, arch.v_head_dim, arch.mtp_num_layers, arch.add_qkv_bias) == (
        768, 192, 256, 1, False)
    training = config.training
    assert (training.pipeline_model_parallel_size, training.decoder_last_pipeline_num_layers,
            training.context_parallel_size, training.enable_mtp_training, training.mtp_loss_scaling_factor) == (
        2, 23, 2, True, 0.2)
    assert config.sglang.extra_args["speculative_algorithm"] == "EAGLE"
    problems = [str(p) for p in collect_problems(config, check_files=False)]
    assert problems == ["training.expert_model_parallel_size: ETP x EP x PP = 1 x 8 x 2 = 16 does not divide the "
                        "trainer's 8 GPUs (Megatron builds expert groups of ETP x EP ranks in every pipeline stage)"]


def test_glm47_flash_line_with_ep4_dry_runs(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*GLM47_FLASH_LINE, "--expert-model-parallel-size", "4", "--dry-run", "--no-check-files",
                 "--executor", "local"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "TP 2 x PP 2 x CP 2 x DP 1 = 8" in out and "ETP 1 x EP 4 x expert-DP 1 = 4; 64 experts, 16 per EP rank" in out
    assert "pipeline stages: layers 0-23 | layers 24-46 + 1 MTP layer(s)" in out
    assert "30.59B parameters, 3.97B active per token" in out  # 29.94B + the MTP layer
    assert "engine GPU (8 GPU(s) per engine, attention TP 1)" in out
    assert "speculative decoding's draft model and its KV cache are not counted" in out
    assert "DOES NOT FIT" not in out


RECIPE_FIELDS = (
    "cluster.actor_num_gpus_per_node", "cluster.rollout_num_gpus", "cluster.rollout_num_gpus_per_engine",
    "cluster.colocate", "rollout.rm_type", "rollout.num_rollout", "rollout.rollout_batch_size",
    "rollout.n_samples_per_prompt", "rollout.rollout_max_response_len", "rollout.over_sampling_batch_size",
    "rollout.dynamic_sampling_filter_path", "training.global_batch_size", "training.num_steps_per_rollout",
    "training.tensor_model_parallel_size", "training.sequence_parallel", "training.pipeline_model_parallel_size",
    "training.decoder_last_pipeline_num_layers", "training.context_parallel_size", "training.expert_tensor_parallel_size",
    "training.max_tokens_per_gpu", "training.recompute_granularity", "training.enable_mtp_training",
    "training.mtp_loss_scaling_factor", "training.moe_token_dispatcher_type", "training.moe_enable_deepep",
    "training.moe_grouped_gemm", "training.moe_permute_fusion", "training.moe_router_dtype",
    "training.moe_router_load_balancing_type", "training.moe_router_bias_update_rate", "training.moe_aux_loss_coeff",
    "algorithm", "optimizer", "eval.eval_interval", "eval.n_samples_per_eval_prompt", "eval.eval_max_response_len",
    "eval.eval_top_p", "sglang.mem_fraction_static", "sglang.cuda_graph_bs", "sglang.extra_args",
)


@pytest.mark.parametrize(("recipe", "line", "changed"), [
    ("configs/moonlight_16b_a3b_grpo.yaml", MOONLIGHT_LINE, {}),
    ("configs/glm4_7_flash_grpo.yaml", GLM47_FLASH_LINE, {"training.expert_model_parallel_size": (8, 4)}),
])
def test_recipes_are_slimes_lines(in_repo: Path, recipe: str, line: list[str],
                                  changed: dict[str, tuple[int, int]]) -> None:
    from_line, from_yaml = load_config([], line), load_config([recipe])
    for path in (*RECIPE_FIELDS, "training.expert_model_parallel_size"):
        ours, theirs = config_field(from_yaml, path), config_field(from_line, path)
        assert (theirs, ours) == changed[path] if path in changed else ours == theirs, path
    file_arch, line_arch = ModelArchitecture.from_yaml(from_yaml.model), from_line.model_args
    assert line_arch is not None
    differs = {"family": "glm4_moe_lite"} if "glm" in recipe else {}  # config.json names the family; the flags cannot
    assert file_arch.to_dict() == {**line_arch.to_dict(), **differs}
    assert collect_problems(from_yaml, check_files=False) == []
    assert "DOES NOT FIT" not in plan_summary(from_yaml, file_arch)
