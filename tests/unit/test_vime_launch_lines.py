"""Issue 25: vime's launch lines (slime's flags with vLLM's engine options as --vllm-*) run unchanged on hpc_rl's
SGLang engines; the 4-node recipe carries Modal's tutorial numbers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.config.sglang_options import option_problems, pinned_options
from hpc_rl.config.validation import collect_problems
from hpc_rl.config.vllm_flags import VLLM_REFUSED, VLLM_TO_SGLANG
from hpc_rl.submit import main
from tests.unit.slime_lines import resolved_from_dry_run, seed_argv, seeds

VIME_SEEDS = "vime_seeds.yaml"


@pytest.mark.parametrize("name", sorted(seeds(VIME_SEEDS)))
def test_vime_line_dry_runs_unchanged(name: str, in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = seed_argv(name, VIME_SEEDS)
    code = main([*argv, "--dry-run", "--no-check-files", "--executor", "local"])
    out, err = capsys.readouterr()
    assert code == 0, err
    resolved, expect = resolved_from_dry_run(out), seeds(VIME_SEEDS)[name]["expect"]
    cluster, sglang = resolved["cluster"], resolved["sglang"]
    assert cluster["actor_num_nodes"] * cluster["actor_num_gpus_per_node"] == expect["trainer_gpus"]
    assert (cluster["rollout_num_gpus"], cluster["colocate"]) == (expect["rollout_num_gpus"], expect["colocate"])
    assert cluster["rollout_num_gpus_per_engine"] == expect["engine_tp"]  # vLLM's tensor_parallel_size
    assert f"engines: {expect['num_engines']}\n" in out  # the topology the dry run prints
    assert out.count(f"GPUs [") == expect["num_engines"] and ", GPUs [0, 1]," in out
    assert sglang["mem_fraction_static"] == expect["mem_fraction_static"]
    assert sglang["extra_args"] == expect["sglang_options"]
    assert resolved["training"]["train_memory_margin_bytes"] == expect["train_memory_margin_bytes"]
    assert resolved["training"]["num_steps_per_rollout"] == expect["num_steps_per_rollout"]
    assert {d["name"]: d["path"] for d in resolved["eval"]["eval_prompt_data"]} == expect["eval"]
    assert resolved["eval"]["eval_interval"] == expect["eval_interval"]
    vllm_flags = [token for token in argv if token.startswith("--vllm-")]
    mapping_lines = [line for line in err.splitlines() if " is vLLM's; " in line]
    assert len(mapping_lines) == len(vllm_flags)  # one printed line per mapping
    assert all(any(line.split("hpc_rl.submit: ")[1].startswith(flag) for line in mapping_lines) for flag in vllm_flags)


REPRESENTATIVE_VALUES = {"kv_cache_dtype": "fp8", "scheduling_policy": "fcfs", "router_policy": "round_robin",
                         "cuda_graph_sizes": [1, 2, 4], "quantization": "fp8", "load_format": "safetensors",
                         "dtype": "bfloat16", "revision": "main", "download_dir": "/tmp/hf",
                         "gpu_memory_utilization": 0.7, "server_concurrency": 64}


@pytest.mark.parametrize("option", sorted(VLLM_TO_SGLANG))
def test_every_mapping_lands_on_an_option_of_the_pinned_sglang(option: str) -> None:
    value = REPRESENTATIVE_VALUES.get(option, 7 if "max" in option or "size" in option or "gb" in option else True)
    config = load_config([], [f"--vllm-{option.replace('_', '-')}", *([] if value is True else
                                                                      [str(v) for v in (value if isinstance(value, list)
                                                                                        else [value])])])
    extra = config.sglang.server_options()
    assert option_problems(extra, pinned_options()) == {}, extra


@pytest.mark.parametrize(("flags", "field", "expected"), [
    (["--vllm-gpu-memory-utilization", "0.7"], "mem_fraction_static", 0.7),
    (["--vllm-max-num-seqs", "256"], "max_running_requests", 256),
    (["--vllm-max-num-batched-tokens", "8192"], "chunked_prefill_size", 8192),
    (["--vllm-enforce-eager"], "disable_cuda_graph", True),
    (["--vllm-max-model-len", "32768"], "context_length", 32768),
    (["--vllm-no-enable-prefix-caching"], "disable_radix_cache", True),
    (["--vllm-enable-chunked-prefill", "false"], "chunked_prefill_size", -1),
    (["--vllm-kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8_e4m3"),
    (["--vllm-block-size", "16"], "page_size", 16),
    (["--vllm-cuda-graph-sizes", "1", "2", "4"], "cuda_graph_bs", [1, 2, 4]),
])
def test_vllm_options_become_their_sglang_equivalents(flags: list[str], field: str, expected: object) -> None:
    options = load_config([], flags).sglang.server_options()
    assert options[field] == expected


def test_each_mapping_is_one_log_line_naming_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hpc_rl.config"):
        load_config([], ["--vllm-max-num-seqs", "256", "--vllm-enforce-eager", "--vllm-enable-sleep-mode"])
    lines = [r.getMessage() for r in caplog.records if "vLLM's" in r.getMessage()]
    assert lines[0] == "--vllm-max-num-seqs 256 is vLLM's; hpc_rl's SGLang engines get --max-running-requests 256"
    assert lines[1].startswith("--vllm-enforce-eager True is vLLM's; hpc_rl's SGLang engines get --disable-cuda-graph True")
    assert lines[2].startswith("--vllm-enable-sleep-mode is vLLM's; accepted: colocated SGLang engines")
    assert len(lines) == 3


@pytest.mark.parametrize(("flags", "reason"), [
    (["--vllm-tensor-parallel-size", "2"], "--rollout-num-gpus-per-engine"),
    (["--vllm-swap-space", "4"], "no CPU swap space"),
    (["--vllm-kv-cache-dtype", "fp8_inc"], "has no SGLang KV-cache dtype"),
    (["--vllm-router-policy", "consistent_hash"], "not a policy of sglang-router"),
    (["--vllm-enable-lora"], "has no SGLang equivalent in hpc_rl's table"),
    (["--vllm-config", "vllm.yaml"], "not offered"),
])
def test_vllm_options_without_an_equivalent_are_refused_with_the_reason(flags: list[str], reason: str) -> None:
    with pytest.raises(ConfigError, match=rf"{flags[0]} is refused: .*{reason}"):
        load_config([], flags)


def test_every_refusal_says_what_to_do() -> None:
    assert all(len(reason) > 20 for reason in VLLM_REFUSED.values())
    assert not set(VLLM_REFUSED) & set(VLLM_TO_SGLANG)


def test_a_lone_eval_path_is_named_aime_as_slime_names_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hpc_rl.config"):
        config = load_config([], ["--eval-prompt-data", "/data/aime.jsonl"])
    assert [(d.name, d.path) for d in config.eval.eval_prompt_data] == [("aime", "/data/aime.jsonl")]
    assert any("[legacy]" in r.getMessage() for r in caplog.records)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval:\n  eval_prompt_data: /data/aime.jsonl\n")
    assert load_config([recipe]).eval.eval_prompt_data[0].name == "aime"
    with pytest.raises(ConfigError, match="odd count"):
        load_config([], ["--eval-prompt-data", "aime", "/a.jsonl", "gsm8k"])


def test_vime_plugin_paths_map_as_slimes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hpc_rl.config"):
        config = load_config([], [
            "--dynamic-sampling-filter-path", "vime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
            "--buffer-filter-path", "vime.rollout.filter_hub.buffer_filters.pop_first",
            "--custom-rm-path", "vime.rollout.rm_hub.deepscaler.get_deepscaler_rule_based_reward",
            "--custom-generate-function-path", "vime.rollout.vllm_rollout.generate",
            "--rollout-function-path", "vime.rollout.vllm_rollout.generate_rollout",
        ])
    rollout = config.rollout
    assert rollout.dynamic_sampling_filter_path == "hpc_rl.rollout.filters.check_reward_nonzero_std"
    assert rollout.buffer_filter_path == "hpc_rl.rollout.filters.pop_first"
    assert (rollout.custom_rm_path, rollout.rm_type) == (None, "deepscaler")
    assert rollout.custom_generate_function_path is None
    assert len([r for r in caplog.records if "is slime's" in r.getMessage()]) == 4
    with pytest.raises(ConfigError, match="slime module hpc_rl has no equivalent"):
        load_config([], ["--custom-rm-path", "vime.rollout.rm_hub.gpqa.compute_gpqa_reward"])


def test_train_memory_margin_is_read_and_checked() -> None:
    assert load_config([], ["--train-memory-margin-bytes", "2147483648"]).training.train_memory_margin_bytes == 2**31
    assert load_config([]).training.train_memory_margin_bytes == 2**30  # vime's default: 1 GiB
    config = load_config([], ["--train-memory-margin-bytes", "-1"])
    assert any("train_memory_margin_bytes" in str(p) for p in collect_problems(config, check_files=False))


def test_the_4_node_recipe_carries_the_tutorials_numbers(in_repo: Path) -> None:
    config = load_config(["configs/qwen3_4b_grpo_4nodes.yaml"])
    assert collect_problems(config, check_files=False) == []
    rollout, training = config.rollout, config.training
    assert (rollout.rollout_batch_size, rollout.n_samples_per_prompt, rollout.num_rollout) == (64, 8, 3000)
    assert (training.global_batch_size, training.num_steps_per_rollout) == (128, 4)
    assert config.cluster.trainer_world_size == 32 and config.cluster.colocate
    header = Path("configs/qwen3_4b_grpo_4nodes.yaml").read_text().split("\nmodel:")[0]
    assert "gym.modal.dev/tutorials/rl/slime_gsm8k" in header and "8 or 16" in header
    for nodes, batch in ((1, 8), (2, 16)):  # the tutorial's global batches for fewer nodes stay valid
        smaller = load_config(["configs/qwen3_4b_grpo_4nodes.yaml"],
                              ["--actor-num-nodes", str(nodes), "--global-batch-size", str(batch),
                               "--num-steps-per-rollout", str(512 // batch)])
        assert collect_problems(smaller, check_files=False) == []


def test_the_colocated_memory_plan_keeps_the_train_memory_margin() -> None:
    """--train-memory-margin-bytes is part of the colocated training phase of the per-GPU memory plan."""
    from hpc_rl.config.memory_plan import plan_memory
    from hpc_rl.config.model_checks import run_architecture

    def training_phase(*flags: str) -> tuple[int, dict[str, int]]:
        config = load_config([], seed_argv("vime_qwen3_4b_colocated_8", VIME_SEEDS) + list(flags))
        phase = next(p for p in plan_memory(config, run_architecture(config)).phases if p.name == "colocated training")
        return phase.total, dict(phase.parts)

    one_gib, items = training_phase("--train-memory-margin-bytes", str(2**30))
    three_gib, _ = training_phase("--train-memory-margin-bytes", str(3 * 2**30))
    assert items["train memory margin"] == 2**30 and three_gib - one_gib == 2 * 2**30
