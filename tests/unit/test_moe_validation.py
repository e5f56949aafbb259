"""Issue 19 item 2: what Megatron or SGLang would refuse after the queue wait is refused at submit, naming the
numbers; GPU-only choices on cpu get one note line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.validation import collect_problems
from hpc_rl.submit import main
from tests.unit.config_problems import codes, config_problems

RECIPE = "configs/qwen3_30b_a3b_grpo.yaml"
TINY_MOE = ["--model", "configs/models/tiny_qwen3.yaml", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
            "--moe-router-topk", "2", "--hf-checkpoint", "/nonexistent/tiny-moe"]


@pytest.fixture(autouse=True)
def _from_repo(in_repo: Path) -> None:
    """Recipes and model files are read from the repository root."""


def problems(files: list[str], flags: list[str]) -> dict[str, str]:
    """Field -> its problems' messages (joined when a field has several), at load or at validation."""
    found: dict[str, str] = {}
    for problem in config_problems(files, flags):
        found[problem.where] = "\n".join(filter(None, (found.get(problem.where), problem.message)))
    return found


def test_slimes_recipe_has_no_problem() -> None:
    assert problems([RECIPE], []) == {}


@pytest.mark.parametrize(("flags", "where", "code", "expected"), [
    (["--expert-model-parallel-size", "6"], "training.expert_model_parallel_size", "not_divisible",
     "the model's 128 experts do not split over EP 6"),
    (["--expert-model-parallel-size", "16"], "training.expert_model_parallel_size", "not_divisible",
     "ETP x EP x PP = 1 x 16 x 1 = 16 does not divide the trainer's 8 GPUs"),
    (["--expert-tensor-parallel-size", "2"], "training.expert_model_parallel_size", "not_divisible",
     "ETP x EP x PP = 2 x 8 x 1 = 16 does not divide"),
    (["--no-sequence-parallel"], "training.sequence_parallel", "needs", "MoE with TP 4 needs sequence parallelism"),
    (["--moe-token-dispatcher-type", "alltoall_seq"], "training.moe_token_dispatcher_type", "not_one_of",
     "'alltoall_seq' is not one of alltoall, allgather, flex"),
    (["--moe-router-dtype", "bf16"], "training.moe_router_dtype", "not_one_of", "'bf16' is not one of fp32, fp64 (or null)"),
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-expert-capacity-factor", "1.5"],
     "training.moe_expert_capacity_factor", "unsupported", "not 'sinkhorn'"),
    (["--moe-token-drop-policy", "random"], "training.moe_token_drop_policy", "not_one_of", "'random' is not one of probs, position"),
    (["--moe-enable-deepep"], "training.moe_enable_deepep", "needs", "DeepEP runs behind the flex dispatcher only"),
    (["--moe-router-topk", "1"], "model", "needs", "top-1 softmax routing needs --moe-router-pre-softmax"),
    (["--moe-router-group-topk", "2", "--moe-router-num-groups", "3"], "model", "not_divisible",
     "moe_router_num_groups (3) must divide the 128 experts"),
    (["--no-use-precision-aware-optimizer"], "optimizer.optimizer_cpu_offload", "needs",
     "needs --use-precision-aware-optimizer"),
    (["--no-optimizer-cpu-offload"], "optimizer.overlap_cpu_optimizer_d2h_h2d", "unused", "is read only with --optimizer-cpu-offload"),
    (["--optimizer", "sgd"], "optimizer.use_precision_aware_optimizer", "unsupported", "works with adam only"),
    (["--optimizer-offload-fraction", "1.5"], "optimizer.optimizer_offload_fraction", "out_of_range", "1.5 is out of range"),
    (["--sglang-dp-size", "2"], "sglang.extra_args.dp_size", "needs", "2 without enable_dp_attention starts 2 server replicas"),
    (["--sglang-enable-dp-attention", "--sglang-dp-size", "3"], "sglang.extra_args.dp_size", "not_divisible",
     "attention DP 3 does not divide the engine's 8 GPUs"),
    (["--sglang-enable-dp-lm-head"], "sglang.extra_args.enable_dp_lm_head", "needs", "needs attention DP"),
    (["--sglang-moe-dense-tp-size", "2"], "sglang.extra_args.moe_dense_tp_size", "unsupported", "SGLang takes 1 or the engine's TP"),
    (["--sglang-ep-size", "3"], "sglang.extra_args.ep_size", "not_divisible", "EP 3 does not divide the engine's 8 GPUs"),
])
def test_moe_problems_name_the_numbers(flags: list[str], where: str, code: str, expected: str) -> None:
    found = config_problems([RECIPE], flags)
    assert (where, code) in codes(found), found
    assert expected in "\n".join(p.message for p in found if p.field == where), found  # the numbers and the fix


def test_redundant_experts_make_sglang_ep_divide() -> None:
    line = ["--rollout-num-gpus-per-engine", "6", "--actor-num-gpus-per-node", "6", "--expert-model-parallel-size", "2",
            "--global-batch-size", "252", "--rollout-batch-size", "63", "--sglang-ep-size", "6"]
    assert "(+ ep_num_redundant_experts) = 128 do not split over EP 6" in problems([RECIPE], line)[
        "sglang.extra_args.ep_size"]
    assert "sglang.extra_args.ep_size" not in problems([RECIPE], [*line, "--sglang-ep-num-redundant-experts", "4"])


def test_expert_parallelism_on_a_dense_model() -> None:
    dense = ["configs/qwen3_4b_grpo.yaml"]
    assert "the model is dense" in problems(dense, ["--expert-model-parallel-size", "2"])[
        "training.expert_model_parallel_size"]
    assert "the model is dense" in problems(dense, ["--expert-tensor-parallel-size", "4"])[
        "training.expert_tensor_parallel_size"]
    assert problems(dense, ["--expert-tensor-parallel-size", "1"]) == {}  # slime's dense scripts pass it
    assert "this model is dense" in problems(dense, ["--use-rollout-routing-replay"])[
        "training.use_rollout_routing_replay"]
    assert "the model is dense" in problems(dense, ["--sglang-ep-size", "2"])["sglang.extra_args.ep_size"]


def test_routing_replay_is_accepted_for_moe() -> None:
    assert problems([RECIPE], ["--use-routing-replay", "--use-rollout-routing-replay"]) == {}


def test_flex_and_deepep_only_on_cuda() -> None:
    found = problems(["configs/tiny_cpu.yaml"], [*TINY_MOE, "--moe-token-dispatcher-type", "flex",
                                                  "--moe-enable-deepep"])
    assert "flex dispatches through DeepEP, a CUDA library" in found["training.moe_token_dispatcher_type"]
    assert found["training.moe_enable_deepep"] == "DeepEP is a CUDA library; on device cpu drop it"
    for dispatcher in ("alltoall", "allgather"):
        assert problems(["configs/tiny_cpu.yaml"], [*TINY_MOE, "--moe-token-dispatcher-type", dispatcher]) == {}


def test_gpu_only_choices_on_cpu_get_one_note_line(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [*TINY_MOE, "--moe-grouped-gemm", "--moe-permute-fusion", "--optimizer-cpu-offload",
             "--use-precision-aware-optimizer", "--dry-run", "--no-check-files"]
    assert main(["configs/tiny_cpu.yaml", *flags]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "grouped-gemm" in line] == [
        "hpc_rl.submit: --moe-grouped-gemm is a GPU kernel choice; on cpu each local expert runs as its own matmul, "
        "with the same numerics"]
    assert len([line for line in err if "permute-fusion" in line]) == 1
    assert len([line for line in err if "--optimizer-cpu-offload --use-precision-aware-optimizer: Megatron's GPU" in line]) == 1
    config = load_config(["configs/tiny_cpu.yaml"], flags[:-2])
    assert (config.training.moe_grouped_gemm, config.training.moe_permute_fusion) == (True, True)  # kept as given


def test_slimes_sglang_moe_options_pass() -> None:
    """SGLANG_ARGS of slime's docs for Qwen3-30B-A3B (EP8, DP attention) and GLM-4.7's FP8 engines (DeepEP a2a)."""
    assert problems([RECIPE], ["--sglang-ep-size", "8", "--sglang-enable-dp-attention", "--sglang-dp-size", "8",
                               "--sglang-moe-dense-tp-size", "1", "--sglang-enable-dp-lm-head",
                               "--sglang-moe-a2a-backend", "deepep", "--sglang-deepep-mode", "auto"]) == {}
    assert "is not an option of" in problems([RECIPE], ["--sglang-ep-sise", "8"])["sglang.ep_sise"]
