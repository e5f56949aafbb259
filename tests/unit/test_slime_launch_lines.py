"""Issue 10: a slime user's launch line moves over unchanged (no YAML), with slime's semantics."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.validation import collect_problems
from hpc_rl.config.loading import load_resolved_config, write_resolved_config
from hpc_rl.submit import main
from tests.unit.slime_lines import config_field, flags_of, resolved_from_dry_run, seed_argv, seeds

QWEN3_4B = flags_of("qwen3_4B_model_args.txt")
TINY = flags_of("tiny_qwen3_model_args.txt")


@pytest.mark.parametrize("name", sorted(seeds()))
def test_seed_line_dry_runs_without_yaml(name: str, in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*seed_argv(name), "--dry-run", "--no-check-files", "--executor", "local"])
    out, err = capsys.readouterr()
    assert code == 0, err
    resolved = resolved_from_dry_run(out)
    expect = seeds()[name]["expect"]
    arch, cluster, training = resolved["model_args"], resolved["cluster"], resolved["training"]
    assert (arch["num_layers"], arch["hidden_size"], arch["family"]) == (
        expect["num_layers"], expect["hidden_size"], expect["family"])
    assert cluster["actor_num_nodes"] * cluster["actor_num_gpus_per_node"] == expect["trainer_gpus"]
    assert (cluster["rollout_num_gpus"], cluster["colocate"]) == (expect["rollout_num_gpus"], expect["colocate"])
    assert (training["tensor_model_parallel_size"], training["context_parallel_size"]) == (expect["tp"], expect["cp"])
    assert training["max_tokens_per_gpu"] == expect["max_tokens_per_gpu"]
    assert training["num_steps_per_rollout"] == expect["num_steps_per_rollout"]
    assert resolved["eval"]["eval_top_p"] == expect["eval_top_p"]
    for key in ("over_sampling_batch_size", "partial_rollout", "dynamic_sampling_filter_path", "buffer_filter_path"):
        if key in expect:
            assert resolved["rollout"][key] == expect[key]
    if "dynamic_sampling_filter_path" in expect:
        assert "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std is slime's; hpc_rl uses" in err


def test_glm_spec_means_glm4_with_its_architecture() -> None:
    arch = load_config([], seed_argv("glm_z1_9b_4_4")).model_args
    assert arch is not None
    assert (arch.family, arch.num_query_groups, arch.rotary_percent, arch.rotary_interleaved) == ("glm4", 2, 0.5, True)
    assert (arch.add_qkv_bias, arch.add_bias_linear, arch.post_sublayer_norms, arch.tie_word_embeddings) == (
        True, False, True, False)


def test_qwen3_flags_use_megatron_defaults_for_what_they_leave_out() -> None:
    arch = load_config([], QWEN3_4B).model_args
    assert arch is not None
    assert arch.tie_word_embeddings is True  # no --untie-embeddings-and-output-weights
    assert (arch.family, arch.kv_channels, arch.rotary_base, arch.norm_epsilon) == ("qwen3", 128, 1e6, 1e-6)


def test_flags_override_a_model_file(in_repo: Path) -> None:
    arch = load_config([], ["--model", "configs/models/qwen3_4B.yaml", "--rotary-base", "10000"]).model_args
    assert arch is not None and arch.rotary_base == 10000 and arch.num_layers == 36


def test_vocab_padding_follows_megatrons_flag(in_repo: Path) -> None:
    """--make-vocab-size-divisible-by (slime's GLM-4.7/GLM-5 MODEL_ARGS set it): Megatron's default 128 when
    left out; the trainer's embedding rows are the vocabulary padded to it (and to TP)."""
    from hpc_rl.training.model_provider import padded_vocab_size

    assert load_config([], QWEN3_4B).model_args.make_vocab_size_divisible_by == 128  # type: ignore[union-attr]
    tiny = load_config([], [*TINY, "--make-vocab-size-divisible-by", "8"]).model_args
    assert tiny is not None and tiny.make_vocab_size_divisible_by == 8
    assert padded_vocab_size(tiny.vocab_size, 1, tiny.make_vocab_size_divisible_by) == 24
    assert padded_vocab_size(tiny.vocab_size, 1) == 128 and padded_vocab_size(tiny.vocab_size, 16, 8) == 32
    overridden = load_config([], ["--model", "configs/models/qwen3_4B.yaml", "--make-vocab-size-divisible-by", "64"])
    assert overridden.model_args is not None and overridden.model_args.make_vocab_size_divisible_by == 64
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by"):
        load_config([], [*TINY, "--make-vocab-size-divisible-by", "0"])


def test_model_flags_are_checked_against_hf_config(in_repo: Path) -> None:
    config = load_config([], [*TINY, "--rotary-base", "10000", "--hf-checkpoint", "assets/tiny_qwen3"])
    problems = [str(p) for p in collect_problems(config, check_files=False)]
    assert any("the model flags and assets/tiny_qwen3/config.json disagree: rotary_base" in p for p in problems)


@pytest.mark.parametrize(("flags", "reason"), [
    (["--num-experts", "64", "--moe-shared-expert-gate"], "the gated shared expert.*get_qwen3_5_spec"),
    (["--apply-layernorm-1p"], "zero-centred norms .* are built for the hybrid families"),
    (["--moe-router-topk", "8"], "without --num-experts: Megatron builds a dense model"),
    (["--normalization", "LayerNorm"], "RMSNorm models only"),
    (["--spec", "my_plugins.models", "get_spec"], "GLM4 spec"),
    (["--post-self-attn-layernorm"], "come together"),
    (["--multi-latent-attention"], "builds MLA for the MoE families"),
])
def test_unbuildable_model_flags_are_refused_with_the_reason(flags: list[str], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        load_config([], [*QWEN3_4B, *flags])


def test_colocate_sets_rollout_gpus_to_the_trainers() -> None:
    config = load_config([], ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--colocate"])
    assert config.cluster.rollout_num_gpus == 8
    explicit = load_config([], ["--actor-num-gpus-per-node", "4", "--colocate", "--rollout-num-gpus", "2"])
    assert explicit.cluster.rollout_num_gpus == 2  # given: kept, and validation reports the mismatch


@pytest.mark.parametrize(("flags", "steps", "batch"), [
    (["--global-batch-size", "64"], 4, 64),
    (["--num-steps-per-rollout", "2"], 2, 128),
    ([], 1, 256),
])
def test_num_steps_per_rollout_derived_as_slime(flags: list[str], steps: int, batch: int) -> None:
    config = load_config([], ["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", *flags])
    assert (config.training.num_steps_per_rollout, config.training.global_batch_size) == (steps, batch)


def test_misc_args_accepted_and_other_values_refused() -> None:
    load_config([], flags_of("misc_args.txt") + ["--bf16", "--use-tensorboard", "--balance-data"])
    with pytest.raises(ConfigError, match=r"--attention-dropout 0.1 is refused: hpc_rl trains without dropout"):
        load_config([], ["--attention-dropout", "0.1"])
    with pytest.raises(ConfigError, match=r"--attention-backend 'fused' is refused"):
        load_config([], ["--attention-backend", "fused"])


def test_refused_flags_all_reported_with_what_to_do() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config([], ["--wandb-always-use-train-step", "--debug-rollout-only", "--finetune"])
    text = str(caught.value)
    assert "--wandb-always-use-train-step is refused" in text and "TensorBoard" in text
    assert "--debug-rollout-only is refused" in text
    assert "--finetune is refused" in text and "--ref-load" in text


def test_aliases_async_and_offload() -> None:
    config = load_config([], ["--train-async", "--offload"])
    assert config.rollout.async_rollout is True and config.training.offload_train is True
    colocated = load_config([], ["--colocate", "--actor-num-gpus-per-node", "2"])
    assert colocated.training.offload_train is True  # slime: colocated offloads the trainer by default
    assert load_config([], ["--colocate", "--no-offload-train"]).training.offload_train is False
    assert load_config([], ["--async"]).rollout.async_rollout is True
    assert load_config([], ["--tb-project-name", "slime-dev"]).logging.run_name == "slime-dev"


def test_slime_plugin_paths_map_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hpc_rl.config"):
        config = load_config([], [
            "--buffer-filter-path", "slime.rollout.filter_hub.buffer_filters.pop_first",
            "--custom-rm-path", "slime.rollout.rm_hub.math_dapo_utils.compute_score",
            "--custom-generate-function-path", "slime.rollout.sglang_rollout.generate",
        ])
    assert config.rollout.buffer_filter_path == "hpc_rl.rollout.filters.pop_first"
    assert (config.rollout.custom_rm_path, config.rollout.rm_type) == (None, "dapo")
    assert config.rollout.custom_generate_function_path is None
    assert len([r for r in caplog.records if "is slime's" in r.getMessage()]) == 3
    with pytest.raises(ConfigError, match="slime module hpc_rl has no equivalent"):
        load_config([], ["--custom-rm-path", "slime.rollout.rm_hub.gpqa.compute_gpqa_reward"])


def test_model_flags_become_the_run_model_file(tmp_path: Path) -> None:
    config = load_config([], [*TINY, "--run-dir", str(tmp_path)])
    write_resolved_config(config, tmp_path)
    assert config.model == str(tmp_path / "model.yaml")
    from hpc_rl.config.model import ModelArchitecture

    assert ModelArchitecture.from_yaml(config.model) == config.model_args
    assert load_resolved_config(tmp_path) == config  # every process reads the same architecture back


RECIPE_OF_SEED = {
    "qwen3_4b_colocated_8": "configs/qwen3_4b_grpo.yaml",
    "qwen3_4b_colocated_8_dynamic_partial": "configs/qwen3_4b_grpo_dynamic.yaml",
    "glm_z1_9b_4_4": "configs/glm_z1_9b_grpo.yaml",
}
SAME_FIELDS = (
    "cluster.actor_num_nodes", "cluster.actor_num_gpus_per_node", "cluster.rollout_num_gpus",
    "cluster.rollout_num_gpus_per_engine", "cluster.colocate", "rollout.rm_type", "rollout.num_rollout",
    "rollout.rollout_batch_size", "rollout.n_samples_per_prompt", "rollout.rollout_max_response_len",
    "rollout.rollout_temperature", "rollout.over_sampling_batch_size", "rollout.dynamic_sampling_filter_path",
    "rollout.partial_rollout", "training.global_batch_size", "training.num_steps_per_rollout",
    "training.tensor_model_parallel_size", "training.sequence_parallel", "training.context_parallel_size",
    "training.max_tokens_per_gpu", "training.recompute_granularity", "training.offload_train", "algorithm",
    "optimizer", "eval.eval_interval", "eval.n_samples_per_eval_prompt", "eval.eval_max_response_len",
    "eval.eval_top_p", "sglang.mem_fraction_static",
)
ARCH_FIELDS = ("family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "vocab_size", "rotary_base", "rotary_percent", "rotary_interleaved", "norm_epsilon",
               "tie_word_embeddings", "qk_layernorm", "add_qkv_bias", "add_bias_linear", "post_sublayer_norms")


@pytest.mark.parametrize("seed", sorted(RECIPE_OF_SEED))
def test_yaml_recipes_are_the_seed_lines(seed: str, in_repo: Path) -> None:
    """The shipped recipes hold the seed's numbers (eval_top_p 1, GLM without a memory fraction, ...)."""
    from hpc_rl.config.model import ModelArchitecture

    from_line, from_yaml = load_config([], seed_argv(seed)), load_config([RECIPE_OF_SEED[seed]])
    for path in SAME_FIELDS:
        assert config_field(from_yaml, path) == config_field(from_line, path), path
    file_arch = ModelArchitecture.from_yaml(from_yaml.model)
    for name in ARCH_FIELDS:
        assert getattr(file_arch, name) == getattr(from_line.model_args, name), name
