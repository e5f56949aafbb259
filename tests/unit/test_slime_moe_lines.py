"""Issue 19: slime's Qwen3-30B-A3B and GLM-4.5 launch lines (tests/unit/data/slime_launch_lines, verbatim at
THUDM/slime 624b824a) dry-run with their numbers, layout and memory plan; the YAML recipes hold the same numbers."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpc_rl.config import load_config
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.validation import collect_problems
from hpc_rl.submit import main
from tests.unit.slime_lines import config_field, flags_of

# `python3 train.py` heads of the run scripts, then ${MODEL_ARGS[@]} ${CKPT_ARGS[@]} ... ${MISC_ARGS[@]}.
QWEN3_30B_LINE = [*shlex.split("--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate"),
                  *flags_of("qwen3_30B_A3B_model_args.txt"), *flags_of("qwen3_30B_A3B_rest.txt")]
GLM45_LINE = [*shlex.split("--actor-num-nodes 8 --actor-num-gpus-per-node 8 --colocate"),
              *flags_of("glm4_5_355B_A32B_model_args.txt"), *flags_of("glm4_7_355B_A32B_rest.txt")]


def resolved_from_dry_run(output: str) -> dict[str, Any]:
    return yaml.safe_load(output.split("# resolved config\n", 1)[1].split("# executor:", 1)[0])


def test_qwen3_30b_a3b_line_dry_runs(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*QWEN3_30B_LINE, "--dry-run", "--no-check-files", "--executor", "local"])
    out, err = capsys.readouterr()
    assert code == 0, err
    resolved = resolved_from_dry_run(out)
    arch, training, optimizer = resolved["model_args"], resolved["training"], resolved["optimizer"]
    assert (arch["family"], arch["num_layers"], arch["num_moe_experts"], arch["moe_ffn_hidden_size"],
            arch["moe_router_topk"], arch["moe_layer_freq"]) == ("qwen3_moe", 48, 128, 768, 8, [1] * 48)
    assert (training["tensor_model_parallel_size"], training["sequence_parallel"], training["expert_model_parallel_size"],
            training["expert_tensor_parallel_size"], training["max_tokens_per_gpu"]) == (4, True, 8, 1, 20480)
    assert (training["moe_token_dispatcher_type"], training["moe_grouped_gemm"], training["moe_permute_fusion"],
            training["moe_router_dtype"], training["moe_token_drop_policy"], training["moe_aux_loss_coeff"]) == (
        "alltoall", True, True, "fp32", "probs", 0.0)
    assert (optimizer["optimizer_cpu_offload"], optimizer["overlap_cpu_optimizer_d2h_h2d"],
            optimizer["use_precision_aware_optimizer"]) == (True, True, True)
    assert resolved["sglang"]["cuda_graph_bs"] == [1, 2, 4, 8, *range(16, 257, 8)]
    assert "TP 4 x PP 1 x CP 1 x DP 2 = 8" in out and "ETP 1 x EP 8 x expert-DP 1 = 8; 128 experts, 16 per EP rank" in out
    assert "30.53B parameters, 3.35B active per token" in out
    assert "colocated training: 37.3 of 79.6 GiB (fits)" in out and "DOES NOT FIT" not in out  # with the 1 GiB train memory margin
    # issue 29: the reference (use_kl_loss) swaps in from host memory: no phase counts its weights on the GPU
    assert "reference weights on the GPU: none" in out and "reference weights 7.5" not in out
    assert "GiB per GPU (reference/teacher weights 7.5 + actor weights while swapped out 7.5 + optimizer" in out


def test_glm45_line_dry_runs_with_engines_over_four_nodes_and_colocated_pp4(in_repo: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """GLM-4.5/4.7-355B as slime runs it on 64 GPUs: every MoE number resolves and fits; its 32-GPU engines span 4
    nodes each (SGLang --nnodes 4, one srun step per engine with a task per node) and its colocated weight pushes
    come from a PP 4 trainer (each stage's parameters reach every stage first)."""
    config = load_config([], GLM45_LINE)
    arch = config.model_args
    assert arch is not None
    assert (arch.family, arch.num_layers, arch.num_moe_experts, arch.moe_router_topk_scaling_factor,
            arch.moe_layers()[:4]) == ("glm4_moe", 92, 160, 2.5, [False, False, False, True])
    training = config.training
    assert (training.moe_token_dispatcher_type, training.moe_enable_deepep) == ("flex", True)  # MISC_ARGS win
    assert (training.moe_router_load_balancing_type, training.moe_router_bias_update_rate) == ("seq_aux_loss", 0.0)
    assert config.sglang.extra_args == {"enable_dp_attention": True, "dp_size": 4, "ep_size": 32, "enable_dp_lm_head": True,
                                        "moe_dense_tp_size": 1, "speculative_algorithm": "EAGLE",
                                        "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                                        "speculative_num_draft_tokens": 4}
    assert [str(p) for p in collect_problems(config, check_files=False)] == []
    code = main([*GLM45_LINE, "--dry-run", "--no-check-files", "--executor", "slurm"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "TP 8 x PP 4 x CP 2 x DP 1 = 64" in out and "ETP 1 x EP 16 x expert-DP 1 = 16; 160 experts" in out
    assert "352.80B parameters, 33.63B active per token" in out and "DOES NOT FIT" not in out
    assert "engine GPU (32 GPU(s) per engine, attention TP 8)" in out and "colocated weight push:" in out
    assert "speculative decoding's draft model and its KV cache are not counted" in out
    assert "engine 0: het group 0, nodes 0-3 (SGLang --nnodes 4; node-rank 0 serves HTTP)" in out
    assert "engine 1: het group 0, nodes 4-7" in out and "under PP each stage's parameters reach every stage" in out
    engine_steps = [line for line in out.splitlines() if line.startswith("srun --job-name=engine-")]
    assert len(engine_steps) == 2
    for step in engine_steps:
        assert "--nodes=4 --ntasks=4 --ntasks-per-node=1" in step and "--gpus-per-node=8 --overlap" in step
        assert "--tp-size 32" in step and "--nnodes 4 --dist-init-addr" in step and "--tp-size 8 " in step


RECIPE_FIELDS = (
    "cluster.actor_num_gpus_per_node", "cluster.rollout_num_gpus", "cluster.rollout_num_gpus_per_engine",
    "cluster.colocate", "rollout.rm_type", "rollout.num_rollout", "rollout.rollout_batch_size",
    "rollout.n_samples_per_prompt", "rollout.rollout_max_response_len", "training.global_batch_size",
    "training.tensor_model_parallel_size", "training.sequence_parallel", "training.expert_model_parallel_size",
    "training.expert_tensor_parallel_size", "training.max_tokens_per_gpu", "training.recompute_granularity",
    "training.moe_token_dispatcher_type", "training.moe_grouped_gemm", "training.moe_permute_fusion",
    "training.moe_router_dtype", "training.moe_token_drop_policy", "training.moe_aux_loss_coeff", "algorithm",
    "optimizer", "eval.eval_interval", "eval.n_samples_per_eval_prompt", "eval.eval_max_response_len",
    "sglang.mem_fraction_static", "sglang.cuda_graph_bs",
)


def test_qwen3_30b_recipe_is_slimes_line(in_repo: Path) -> None:
    from_line, from_yaml = load_config([], QWEN3_30B_LINE), load_config(["configs/qwen3_30b_a3b_grpo.yaml"])
    for path in RECIPE_FIELDS:
        assert config_field(from_yaml, path) == config_field(from_line, path), path
    file_arch, line_arch = ModelArchitecture.from_yaml(from_yaml.model), from_line.model_args
    assert line_arch is not None and file_arch.moe_layers() == line_arch.moe_layers()  # the file leaves out "all MoE"
    assert file_arch.to_dict() == {**line_arch.to_dict(), "max_position_embeddings": 40960, "moe_layer_freq": None}


def test_glm45_air_recipe_uses_slimes_model_script(in_repo: Path) -> None:
    air_line = [*shlex.split("--actor-num-nodes 2 --actor-num-gpus-per-node 8 --colocate"),
                *flags_of("glm4_5_106B_A12B_model_args.txt"), *flags_of("glm4_7_355B_A32B_rest.txt")]
    from_line, from_yaml = load_config([], air_line), load_config(["configs/glm4_5_air_grpo.yaml"])
    assert ModelArchitecture.from_yaml(from_yaml.model).to_dict() == {
        **from_line.model_args.to_dict(), "max_position_embeddings": 131072}  # type: ignore[union-attr]
    same = ("rollout.rollout_batch_size", "rollout.n_samples_per_prompt", "rollout.rollout_max_response_len",
            "rollout.over_sampling_batch_size", "rollout.rollout_stop_token_ids", "rollout.dynamic_sampling_filter_path",
            "training.num_steps_per_rollout", "training.global_batch_size", "training.max_tokens_per_gpu",
            "training.recompute_granularity", "training.moe_router_load_balancing_type",
            "training.moe_router_bias_update_rate", "training.moe_router_dtype", "algorithm", "optimizer",
            "eval.eval_max_response_len", "sglang.mem_fraction_static")
    for path in same:
        assert config_field(from_yaml, path) == config_field(from_line, path), path
