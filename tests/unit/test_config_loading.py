"""Config loading: defaults < YAML < CLI, slime's flags, --set, errors with file:line, resolved round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import ConfigError, load_config, load_resolved_config, write_resolved_config
from hpc_rl.config.sections.rollout import EvalDataset


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_precedence_defaults_yaml_cli(tmp_path: Path) -> None:
    first = write(tmp_path, "rollout_batch_size: 4\nrollout:\n  n_samples_per_prompt: 2\n", "a.yaml")
    second = write(tmp_path, "rollout_batch_size: 6\n", "b.yaml")
    config = load_config([first, second], ["--n-samples-per-prompt", "3"])
    assert config.rollout.rollout_batch_size == 6
    assert config.rollout.n_samples_per_prompt == 3
    assert config.training.global_batch_size == 18  # slime: rollout_batch_size * n_samples_per_prompt, one step
    assert config.training.num_steps_per_rollout == 1


def test_slime_flags_verbatim() -> None:
    config = load_config([], [
        "--rollout-batch-size", "32", "--colocate", "--eval-prompt-data", "aime", "/d/aime.jsonl", "gsm", "/d/g.jsonl",
        "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2", "4", "--lr", "1e-6",
        "--rollout-stop", "</s>", "<|im_end|>", "--no-rollout-shuffle", "--sglang-enable-memory-saver",
    ])
    assert config.rollout.rollout_batch_size == 32
    assert config.cluster.colocate is True
    assert config.eval.eval_prompt_data == [EvalDataset(name="aime", path="/d/aime.jsonl"),
                                            EvalDataset(name="gsm", path="/d/g.jsonl")]
    assert config.sglang.mem_fraction_static == 0.7
    assert config.sglang.cuda_graph_bs == [1, 2, 4]
    assert config.optimizer.lr == 1e-6
    assert config.rollout.rollout_stop == ["</s>", "<|im_end|>"]
    assert config.rollout.rollout_shuffle is False
    assert config.sglang.extra_args == {"enable_memory_saver": True}


def test_set_override_and_derived_defaults() -> None:
    config = load_config([], ["--set", "algorithm.eps_clip=0.3", "--set", "rollout.rollout_batch_size=12"])
    assert config.algorithm.eps_clip == 0.3
    assert config.algorithm.eps_clip_high == 0.3  # follows eps_clip when not given
    assert config.rollout.over_sampling_batch_size == 12  # follows rollout_batch_size


def test_unknown_key_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  n_samples_per_prompt: 2\n  rollout_batch_sise: 3\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: rollout has no field 'rollout_batch_sise'; did you mean 'rollout_batch_size'"):
        load_config([path])


def test_wrong_type_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "model: m.yaml\nglobal_batch_size: many\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: training.global_batch_size: 'many' is not an integer") as refused:
        load_config([path])
    assert [(p.field, p.code, p.location) for p in refused.value.problems] == [
        ("training.global_batch_size", "bad_type", f"{path}:2")]


def test_unknown_cli_flag_suggests() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'n_sample_per_prompt'; did you mean 'n_samples_per_prompt'"):
        load_config([], ["--n-sample-per-prompt", "8"])


def test_incomplete_model_flags_say_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="model flags without --hidden-size, --ffn-hidden-size"):
        load_config([], ["--num-layers", "36", "--swiglu", "--normalization", "RMSNorm",
                         "--use-rotary-position-embeddings", "--num-attention-heads", "4", "--vocab-size", "10"])


def test_section_invariant_reports_origin(tmp_path: Path) -> None:
    path = write(tmp_path, "algorithm:\n  advantage_estimator: grpoo\n")
    with pytest.raises(ConfigError, match="advantage_estimator: 'grpoo' is not one of") as refused:
        load_config([path])
    assert [(p.field, p.code, p.location) for p in refused.value.problems] == [
        ("algorithm.advantage_estimator", "not_one_of", f"{path}:2")]


def test_section_invariants_point_at_the_line_of_their_own_field(tmp_path: Path) -> None:
    """A section's own rule (`__post_init__`) is reported at the line that set the field it names, not at the
    section's first setting; a Literal field's value at its own line too, and every problem in one pass."""
    path = write(tmp_path, "algorithm:\n  eps_clip: 0.1\n  kl_loss_type: k9\n  eps_clip_c: 0.5\n"
                           "training:\n  seed: 3\n  context_parallel_size: 2\n  qkv_format: bshd\n")
    with pytest.raises(ConfigError) as refused:
        load_config([path], ["--routing-replay-prefetch-microbatches", "-1"])
    located = {(p.field, p.code, p.location) for p in refused.value.problems}
    assert located == {("algorithm.kl_loss_type", "not_one_of", f"{path}:3"),
                       ("algorithm.eps_clip_c", "out_of_range", f"{path}:4"),
                       ("training.qkv_format", "unsupported", f"{path}:8"),
                       ("training.routing_replay_prefetch_microbatches", "out_of_range",
                        "command line --routing-replay-prefetch-microbatches")}
    assert f"{path}:4: algorithm.eps_clip_c: 0.5 must be > 1" in str(refused.value)  # the field and the fix


def test_sequence_parallel_at_tp_1_is_off_as_in_megatron() -> None:
    from hpc_rl.config.sections.training import TrainingConfig

    assert load_config([], ["--sequence-parallel"]).training.sequence_parallel is False
    assert TrainingConfig(sequence_parallel=True).sequence_parallel is False  # one rule, wherever it is built
    assert TrainingConfig(sequence_parallel=True, tensor_model_parallel_size=2).sequence_parallel is True


def test_resolved_config_round_trip(tmp_path: Path) -> None:
    config = load_config([], ["--colocate", "--eval-prompt-data", "a", "/p", "--sglang-foo", "3", "--model", "m.yaml"])
    write_resolved_config(config, tmp_path)
    assert (tmp_path / "config.resolved.yaml").is_file()
    assert load_resolved_config(tmp_path) == config


def test_eval_pairs_must_be_even() -> None:
    """One path alone is slime's legacy form (named aime: tests/unit/test_vime_launch_lines.py); 3 is an error."""
    with pytest.raises(ConfigError, match="name/path pairs, got an odd count"):
        load_config([], ["--eval-prompt-data", "aime", "/a.jsonl", "gsm8k"])


def test_importing_the_config_changes_no_state() -> None:
    """Issue 13 item 5: the flat key index is built on first use, not at import."""
    import subprocess
    import sys

    code = ("import hpc_rl.config.loading, hpc_rl.config.settings_sources as s; "
            "print(s.flat_index.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "0"


def test_sglang_extra_args_as_a_mapping_or_one_option_on_the_command_line(tmp_path: Path) -> None:
    config = load_config([write(tmp_path, "sglang:\n  extra_args: {enable_memory_saver: true}\n")], [
        "--set", 'sglang.extra_args={"chunked_prefill_size": 4096}',  # old: IndexError while loading
        "--set", "sglang.extra_args.mem_fraction_static=0.5",  # old: "sglang has no field 'extra_args.mem_...'"
        "--set", "sglang.extra_args={schedule_policy: lpm}"])
    assert config.sglang.extra_args == {"enable_memory_saver": True, "chunked_prefill_size": 4096,
                                        "mem_fraction_static": 0.5, "schedule_policy": "lpm"}
    with pytest.raises(ConfigError) as refused:
        load_config([], ["--set", "sglang.extra_args=4096"])
    assert ("--set sglang.extra_args: sglang.extra_args: expected a mapping of SGLang server options, got 4096; write --set "
            "'sglang.extra_args={chunked_prefill_size: 4096}'") in str(refused.value)
