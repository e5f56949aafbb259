"""Issue 19 item 3 / issue 22 item 4: parameter counts (against published totals), the parallel layout with
experts, and the per-GPU memory plan's arithmetic and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.recipes import RECIPES, skip_without_family
from hpc_rl.config import load_config
from hpc_rl.config.memory_plan import (
    BF16, FP32, GIB, HOST_OPTIMIZER_BYTES, OPTIMIZER_BYTES, PRECISION_AWARE_OPTIMIZER_BYTES, plan_memory,
    trainer_memory,
)
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.parallel_layout import ParallelLayout
from hpc_rl.config.parameter_counts import model_share, stage_shares
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.validation import collect_problems


@pytest.fixture(autouse=True)
def _from_repo(in_repo: Path) -> None:
    """Model files and recipes are read from the repository root."""


def arch(name: str) -> ModelArchitecture:
    return ModelArchitecture.from_yaml(f"configs/models/{name}.yaml")


@pytest.mark.parametrize(("model", "total", "active", "active_without_embeddings"), [
    ("qwen3_4B", 4.0e9, 4.0e9, 3.6e9),             # Qwen3-4B: 4.0B, 3.6B non-embedding
    ("qwen3_30B_A3B", 30.5e9, 3.3e9, None),        # Qwen3-30B-A3B: 30.5B total, 3.3B activated
    ("glm4_5_air", 106e9, None, 12e9),             # GLM-4.5-Air: 106B total, 12B active
])
def test_parameter_counts_match_published_totals(model: str, total: float, active: float | None,
                                                  active_without_embeddings: float | None) -> None:
    """The model files are checked against the published config.json in test_moe_flags; these are the model
    cards' totals (rounded there, so within 2%)."""
    share = model_share(arch(model))
    assert share.total == pytest.approx(total, rel=0.02)
    if active is not None:
        assert share.active == pytest.approx(active, rel=0.02)
    if active_without_embeddings is not None:
        assert share.active - share.vocab_parallel == pytest.approx(active_without_embeddings, rel=0.02)


def test_qwen3_30b_counts_exactly() -> None:
    h, experts, inner, layers, vocab = 2048, 128, 768, 48, 151936
    attention = h * 4096 + 2 * h * 512 + 4096 * h
    norms = 2 * h + 2 * 128
    share = model_share(arch("qwen3_30B_A3B"))
    assert share.experts == layers * experts * 3 * h * inner
    assert share.active_experts == layers * 8 * 3 * h * inner
    assert share.tensor_parallel == layers * attention
    assert share.replicated == layers * (norms + experts * h) + h
    assert share.vocab_parallel == 2 * vocab * h


def test_pipeline_stages_split_layers_and_embeddings() -> None:
    model = arch("glm4_5_air")
    stages = stage_shares(model, 2)
    assert sum(s.total for s in stages) == model_share(model).total
    assert stages[0].vocab_parallel == stages[1].vocab_parallel == model.vocab_size * model.hidden_size
    assert stages[0].experts < stages[1].experts  # the dense first layer is on stage 0


def qwen3_30b(*flags: str) -> RunConfig:
    return load_config(["configs/qwen3_30b_a3b_grpo.yaml"], list(flags))


def test_layout_of_slimes_qwen3_30b_recipe() -> None:
    config = qwen3_30b()
    layout = ParallelLayout.of(config.training, config.cluster.trainer_world_size, arch("qwen3_30B_A3B"))
    assert (layout.tp, layout.pp, layout.cp, layout.dp, layout.ep, layout.etp, layout.expert_dp) == (4, 1, 1, 2, 8, 1, 1)
    assert (layout.dense_optimizer_shards, layout.expert_optimizer_shards) == (2, 1)
    text = layout.describe()
    assert "TP 4 x PP 1 x CP 1 x DP 2 = 8" in text and "ETP 1 x EP 8 x expert-DP 1 = 8; 128 experts, 16 per EP rank" in text
    wide = ParallelLayout.of(load_config(["configs/glm4_5_air_grpo.yaml"]).training, 32, arch("glm4_5_air"))
    assert (wide.dp, wide.expert_dp, wide.dense_optimizer_shards) == (4, 2, 8)  # CP folds into expert-DP


def test_trainer_memory_per_gpu_by_hand() -> None:
    model = arch("qwen3_30B_A3B")
    share = model_share(model)
    dense = (share.tensor_parallel + share.vocab_parallel) // 4 + share.replicated
    experts = share.experts // 8
    offloaded = qwen3_30b()
    layout = ParallelLayout.of(offloaded.training, 8, model)
    memory = trainer_memory(offloaded, model, layout)
    assert (memory.dense_parameters, memory.expert_parameters) == (dense, experts)
    assert (memory.weights, memory.frozen_weights_in_host, memory.swap_buffer_in_host, memory.grads) == (
        (dense + experts) * BF16, (dense + experts) * BF16, (dense + experts) * BF16, (dense + experts) * FP32)
    assert memory.state == memory.weights + memory.grads + memory.optimizer_on_gpu  # no reference on the GPU
    shards = dense / 2 + experts / 1
    assert memory.optimizer_on_gpu == 0
    assert memory.optimizer_in_host == int(shards * HOST_OPTIMIZER_BYTES)
    assert memory.optimizer_on_gpu_without_offload == int(shards * PRECISION_AWARE_OPTIMIZER_BYTES)
    plain = qwen3_30b("--no-optimizer-cpu-offload", "--no-use-precision-aware-optimizer",
                      "--no-overlap-cpu-optimizer-d2h-h2d")
    assert trainer_memory(plain, model, layout).optimizer_on_gpu == int(shards * OPTIMIZER_BYTES)
    assert memory.activations == memory.activations_full_recompute < memory.activations_no_recompute / 10
    assert memory.logits == 20480 * (151936 // 4) * 10


def test_qwen3_30b_recipe_plan_fits_and_prints() -> None:
    plan = plan_memory(qwen3_30b(), arch("qwen3_30B_A3B"))
    assert plan.problems() == []
    assert [phase.name for phase in plan.phases] == ["colocated generation", "colocated training",
                                                     "colocated weight push"]
    text = plan.describe()
    assert "30.53B parameters, 3.35B active per token" in text and "trainer GPU: 4.02B parameters" in text
    assert "colocated training:" in text and "DOES NOT FIT" not in text
    assert plan.engine.weights == pytest.approx(model_share(arch("qwen3_30B_A3B")).total * BF16 / 8, rel=0.01)


def test_plan_refuses_with_the_numbers() -> None:
    small_gpu = plan_memory(qwen3_30b("--gpu-memory-gib", "36"), arch("qwen3_30B_A3B"))
    assert [(p.field, p.code) for p in small_gpu.problems()] == [("training", "memory")]
    problems = {p.field: p.message for p in small_gpu.problems()}
    assert problems["training"].startswith("colocated training needs 37.3 GiB per GPU (trainer weights 7.5, "
                                           "grads 15.0, activations 1.6, logits 7.2")
    assert "over the GPU's 36.0 GiB (cluster.gpu_memory_gib): add --optimizer-cpu-offload" in problems["training"]


def test_offload_and_recompute_decide_whether_it_fits() -> None:
    """slime's recipe needs its CPU Adam when the trainer stays on the GPU beside the engine's KV cache."""
    kept = ("--no-offload-train",)
    assert plan_memory(qwen3_30b(*kept), arch("qwen3_30B_A3B")).problems()[0].field == "sglang.mem_fraction_static"
    no_recompute = plan_memory(qwen3_30b("--set", "training.recompute_granularity=null"), arch("qwen3_30B_A3B"))
    assert no_recompute.problems() == []  # 34 GiB of activations still fit with CPU Adam
    plain = qwen3_30b("--set", "training.recompute_granularity=null", "--no-optimizer-cpu-offload")
    assert "colocated training needs" in {p.field: p.message for p in plan_memory(plain, arch("qwen3_30B_A3B")).problems()}["training"]


def test_engine_without_room_for_one_sample() -> None:
    config = qwen3_30b("--rollout-num-gpus-per-engine", "1", "--rollout-num-gpus", "8")
    found = plan_memory(config, arch("qwen3_30B_A3B")).problems()
    assert [(p.field, p.code) for p in found] == [("sglang.mem_fraction_static", "memory")]
    problems = {p.field: p.message for p in found}
    assert "minus its weights (56.9 GiB) leaves KV cache for 0 tokens" in problems["sglang.mem_fraction_static"]


def test_decoupled_plan_checks_each_side() -> None:
    config = load_config(["configs/qwen3_4b_grpo_4nodes_decoupled.yaml"])
    plan = plan_memory(config, arch("qwen3_4B"))
    assert [phase.name for phase in plan.phases] == ["trainer, training", "trainer, weight push",
                                                     "engine, generation", "engine, receiving a bucket"]
    assert plan.problems() == []
    huge_bucket = load_config(["configs/qwen3_4b_grpo_4nodes_decoupled.yaml"],
                              ["--update-weight-buffer-size", str(30 * GIB)])
    assert [p.field for p in plan_memory(huge_bucket, arch("qwen3_4B")).problems()] == [
        "rollout.update_weight_buffer_size"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_plan_fits(recipe: str) -> None:
    skip_without_family(recipe)
    config = load_config([f"configs/{recipe}"])
    assert [str(p) for p in collect_problems(config, check_files=False)] == []


def test_recompute_block_keeps_the_other_layers() -> None:
    model = arch("qwen3_30B_A3B")
    layout = ParallelLayout.of(qwen3_30b().training, 8, model)
    uniform = trainer_memory(qwen3_30b(), model, layout)
    block_all = trainer_memory(qwen3_30b("--recompute-method", "block", "--recompute-num-layers", "48"), model, layout)
    block_half = trainer_memory(qwen3_30b("--recompute-method", "block", "--recompute-num-layers", "24"), model, layout)
    assert uniform.activations == block_all.activations < block_half.activations < uniform.activations_no_recompute


@pytest.mark.parametrize(("recipe", "model", "flags"), [
    ("configs/glm4_5_air_grpo.yaml", "glm4_5_air", ["--use-kl-loss"]),  # EP16 on 2x8 trainer GPUs, with a KL term
    ("configs/qwen3_30b_a3b_grpo.yaml", "qwen3_30B_A3B", []),  # slime's Qwen3-30B-A3B line (use_kl_loss)
])
def test_reference_weights_are_host_memory_not_gpu(recipe: str, model: str, flags: list[str]) -> None:
    """Issue 29: one model on the GPU. The reference swaps in from host memory for its pass, so no phase on the
    GPU counts its weights; the host memory per GPU and per node counts them (and the actor's weights, which
    wait in a host buffer during the reference pass)."""
    from hpc_rl.config.memory_plan import plan_summary

    config = load_config([recipe], flags)
    assert config.algorithm.use_kl_loss
    plan = plan_memory(config, arch(model))
    trainer = plan.trainer
    if recipe.startswith("configs/glm"):
        assert (plan.layout.ep, config.cluster.actor_num_nodes, plan.gpus_per_node) == (16, 2, 8)
    assert all(label != "reference weights" for phase in plan.phases for label, _ in phase.parts)
    assert trainer.state == trainer.weights + trainer.grads + trainer.optimizer_on_gpu
    assert trainer.frozen_weights_in_host == trainer.weights == trainer.parameters * BF16 > 0
    assert trainer.swap_buffer_in_host == trainer.weights
    assert plan.host_per_node == 8 * trainer.host
    assert trainer.host == (2 * trainer.weights + trainer.optimizer_in_host + trainer.colocated_offload_in_host)
    text = plan_summary(config, arch(model))
    assert "reference weights on the GPU: none" in text
    assert "GiB per node (8 trainer GPUs)" in text and f"{plan.host_per_node / GIB:.1f} GiB per node" in text
    without = plan_memory(load_config([recipe], [*flags, "--no-use-kl-loss"]), arch(model)).trainer
    assert (without.frozen_weights_in_host, without.swap_buffer_in_host) == (0, 0)
    assert without.state == trainer.state  # the reference costs the GPU nothing
    # colocated: the actor's weights leave for the engines into the swap buffer (one host copy of the actor)
    assert trainer.colocated_offload_in_host == trainer.optimizer_on_gpu
    assert without.colocated_offload_in_host == without.weights + without.optimizer_on_gpu
