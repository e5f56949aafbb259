"""Submit-time validation: every rule has a bad input whose message names the field and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.validation import ValidationFailed, collect_problems, validate
from tests.unit.config_problems import codes, config_problems

TINY = "configs/tiny_cpu.yaml"


def problems_for(flags: list[str], *, check_files: bool = True) -> str:
    config = load_config([TINY], flags)
    return "\n".join(str(p) for p in collect_problems(config, check_files=check_files))


def found_for(flags: list[str], *, check_files: bool = True) -> set[tuple[str, str]]:
    """(field, code) of every problem of the tiny config with `flags`."""
    return codes(config_problems([TINY], flags, check_files=check_files))


@pytest.fixture(autouse=True)
def _from_repo(in_repo: Path) -> None:
    """Every test here runs from the repository root."""


def test_tiny_default_is_valid() -> None:
    validate(load_config([TINY]))


def test_batch_constraint() -> None:
    assert ("rollout.rollout_batch_size", "not_divisible") in found_for(["--global-batch-size", "100"])
    text = problems_for(["--global-batch-size", "100"])
    assert "rollout_batch_size * n_samples_per_prompt (16 * 8 = 128) must equal global_batch_size" in text
    assert "(100 * 1 = 100)" in text


def test_over_sampling_below_rollout_batch() -> None:
    assert ("rollout.over_sampling_batch_size", "out_of_range") in found_for(["--over-sampling-batch-size", "4"])
    assert "rollout.over_sampling_batch_size: 4 is below rollout_batch_size (16)" in problems_for(
        ["--over-sampling-batch-size", "4"])


def test_rollout_gpus_not_divisible_by_engine_size() -> None:
    flags = ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"]
    assert ("cluster.rollout_num_gpus", "not_divisible") in found_for(flags)
    text = problems_for(flags)
    assert "cluster.rollout_num_gpus: 3 is not divisible by rollout_num_gpus_per_engine (2)" in text


def test_model_parallel_must_divide_trainer_gpus() -> None:
    flags = ["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert ("training.tensor_model_parallel_size", "not_divisible") in found_for(flags)
    text = problems_for(flags)
    assert "TP*PP*CP = 2*1*1 = 2 does not divide the trainer's 3 GPUs" in text


def test_colocate_needs_matching_rollout_gpus() -> None:
    flags = ["--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1"]
    assert ("cluster.rollout_num_gpus", "mismatch") in found_for(flags)
    text = problems_for(flags)
    assert "colocate: engines share the trainer's GPUs, so rollout_num_gpus (1) must equal" in text


def test_tp_must_divide_kv_heads() -> None:
    flags = ["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "4"]
    assert ("training.tensor_model_parallel_size", "not_divisible") in found_for(flags)
    text = problems_for(flags)
    assert "TP 4 does not divide the model's 2 KV heads" in text


def test_pp_must_divide_layers() -> None:
    flags = ["--actor-num-gpus-per-node", "3", "--pipeline-model-parallel-size", "3"]
    assert ("training.pipeline_model_parallel_size", "not_divisible") in found_for(flags)
    text = problems_for(flags)
    assert "training.pipeline_model_parallel_size: PP 3 does not divide the model's num_layers (2" in text


def test_missing_files_and_no_check_files() -> None:
    flags = ["--prompt-data", "/nonexistent/train.jsonl", "--hf-checkpoint", "/nonexistent/model"]
    assert {("rollout.prompt_data", "not_found"), ("checkpoint.hf_checkpoint", "not_found")} <= found_for(flags)
    text = problems_for(flags)
    assert "rollout.prompt_data: /nonexistent/train.jsonl does not exist" in text
    assert "checkpoint.hf_checkpoint: /nonexistent/model does not exist" in text
    assert problems_for(flags, check_files=False) == ""


def test_prompt_data_missing_keys(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1", "label": "2"}) + "\n")
    assert ("rollout.prompt_data", "bad_file") in found_for(["--prompt-data", str(data)])
    text = problems_for(["--prompt-data", str(data)])
    assert f"{data}:1: missing input key 'prompt' (fields: label, question); set rollout.input_key" in text
    text = problems_for(["--prompt-data", str(data), "--input-key", "question", "--label-key", "answer"])
    assert "missing label key 'answer'" in text


def test_prompt_data_bad_json_line(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "label": "1"}) + "\n{broken\n")
    assert f"{data}:2: not valid JSON" in problems_for(["--prompt-data", str(data)])


def test_plugin_import_and_signature(tmp_path: Path) -> None:
    plugin = tmp_path / "my_plugins.py"
    plugin.write_text("def sync_reward(args, sample):\n    return 1.0\n\nasync def one_arg(args):\n    return 1.0\n")
    assert ("rollout.custom_rm_path", "plugin") in found_for(["--custom-rm-path", f"{plugin}:sync_reward"])
    text = problems_for(["--custom-rm-path", f"{plugin}:sync_reward"])
    assert "rollout.custom_rm_path" in text and "async" in text
    text = problems_for(["--custom-rm-path", f"{plugin}:one_arg"])
    assert "rollout.custom_rm_path" in text
    assert "rollout.dynamic_sampling_filter_path" in problems_for(
        ["--dynamic-sampling-filter-path", "no_such_module_xyz.keep_all"])
    assert "rollout.buffer_filter_path" in problems_for(["--buffer-filter-path", f"{plugin}:missing_function"])


def test_model_file_vs_hf_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 10000.0
    config["num_hidden_layers"] = 3
    (hf / "config.json").write_text(json.dumps(config))
    assert ("model", "mismatch") in found_for(["--hf-checkpoint", str(hf)])
    text = problems_for(["--hf-checkpoint", str(hf)])
    assert "rotary_base: model file says 1000000.0, config.json says 10000.0" in text
    assert "num_layers: model file says 2, config.json says 3" in text


def test_every_problem_reported_in_one_pass() -> None:
    config = load_config([TINY], ["--global-batch-size", "100", "--over-sampling-batch-size", "4",
                                  "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"])
    with pytest.raises(ValidationFailed) as failure:
        validate(config)
    assert len(failure.value.problems) >= 3


def test_reward_required_and_remote_needs_url() -> None:
    assert ("rollout.rm_url", "needs") in found_for(["--rm-type", "remote_rm"])
    assert "rollout.rm_url: rm_type remote_rm needs rm_url" in problems_for(["--rm-type", "remote_rm"])


def test_colocate_needs_whole_engines_per_node_and_takes_a_pipeline() -> None:
    flags = ["--colocate", "--actor-num-gpus-per-node", "3", "--rollout-num-gpus", "3",
             "--rollout-num-gpus-per-engine", "2", "--pipeline-model-parallel-size", "3"]
    assert ("cluster.rollout_num_gpus_per_engine", "not_divisible") in found_for(flags)
    text = problems_for(flags)
    assert "an engine of 2 GPUs must sit on the GPUs of whole trainer ranks" in text
    assert "training.pipeline_model_parallel_size: colocate" not in text  # colocated pushes work at PP > 1 now


@pytest.mark.parametrize(("flags", "field", "code", "words"), [
    (["--ref-update-interval", "2"], "algorithm.ref_update_interval", "needs", "needs use_kl_loss or kl_coef"),
    (["--ref-ckpt-step", "3"], "checkpoint.ref_ckpt_step", "needs", "ref_load, which is not set"),
    (["--keep-old-actor", "--use-rollout-logprobs"], "algorithm.keep_old_actor", "conflict", "drop one of them"),
    (["--save-hf", "/out/{step}"], "checkpoint.save_hf", "bad_type", "only {rollout_id} in braces"),
    (["--use-score-centering", "--context-parallel-size", "2", "--qkv-format", "thd"],
     "algorithm.use_score_centering", "unsupported", "context_parallel_size 1"),
])
def test_slime_checkpoint_flags_are_checked_at_submit(flags: list[str], field: str, code: str, words: str) -> None:
    problems = [p for p in collect_problems(load_config([], flags), check_files=False) if p.where == field]
    assert problems and (problems[0].field, problems[0].code) == (field, code) and words in problems[0].message


def test_the_model_is_read_once_per_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """One architecture file read and one config.json read per `validate` (it was 4 and 2: each check loaded its
    own), and problems of a loaded config point at the line or flag that set their field."""
    from hpc_rl.config import resolved_model
    from hpc_rl.config.model import ModelArchitecture

    config = load_config([TINY])
    reads: list[str] = []
    real_from_yaml = ModelArchitecture.from_yaml.__func__  # type: ignore[attr-defined]
    real_loads = resolved_model.json.loads
    monkeypatch.setattr(ModelArchitecture, "from_yaml",
                        classmethod(lambda cls, path: reads.append("model") or real_from_yaml(cls, path)))
    monkeypatch.setattr(resolved_model.json, "loads", lambda text: reads.append("config.json") or real_loads(text))
    validate(config, check_files=False)
    assert sorted(reads) == ["config.json", "model"]


def test_validation_problems_point_at_the_setting(tmp_path: Path) -> None:
    """`validate` names the file line or flag that set each field (a default has none)."""
    recipe = tmp_path / "run.yaml"
    recipe.write_text(Path(TINY).read_text() + "\nrollout_num_gpus: 3\n")
    config = load_config([recipe], ["--over-sampling-batch-size", "4", "--rollout-num-gpus-per-engine", "2"])
    with pytest.raises(ValidationFailed) as failure:
        validate(config, check_files=False)
    located = {(p.field, p.code): p.location for p in failure.value.problems}
    lines = recipe.read_text().splitlines()
    assert located[("rollout.over_sampling_batch_size", "out_of_range")] == "command line --over-sampling-batch-size"
    assert located[("cluster.rollout_num_gpus", "not_divisible")] == f"{recipe}:{len(lines)}"
    assert f"{recipe}:{len(lines)}: cluster.rollout_num_gpus: 3 is not divisible" in str(failure.value)
