"""Issue 32: slime's Qwen3-VL-8B FSDP line (scripts/run-qwen3-vl-8B-fsdp.sh, its arrays as bash expands them in
tests/unit/data/slime_launch_lines/qwen3_vl_8B_fsdp_rest.txt) dry-runs as the Megatron trainer: --train-backend fsdp
and each FSDP-only flag print one line saying what it becomes (or are refused with the reason), the multimodal keys
and the geo3k reward resolve."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import pytest

from hpc_rl.config import ConfigError, load_config
from hpc_rl.models.registry import family_names
from hpc_rl.submit import main
from tests.unit.slime_lines import flags_of, resolved_from_dry_run

HEAD = shlex.split("""--multimodal-keys '{"image": "images"}'""")
"""The script's first flag after train.py; then ${CKPT_ARGS[@]} ... ${MISC_ARGS[@]} (the fixture file)."""
MODEL = ["--model", "configs/models/qwen3_vl_8B.yaml"]
"""hpc_rl's own option: slime's FSDP backend read the architecture from the checkpoint's config.json, which
--no-check-files does not read."""


def test_fsdp_flags_print_one_line_each_and_set_megatrons_fields(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hpc_rl.config"):
        config = load_config([], ["--train-backend", "fsdp", "--gradient-checkpointing", "--attn-implementation",
                                  "flash_attention_3", "--fsdp-full-params", "--fsdp-cpu-offload",
                                  "--warmup-ratio", "0.03", "--fsdp-state-dict-cpu-offload",
                                  "--fsdp-cpu-backend", "gloo"])
    lines = [r.getMessage() for r in caplog.records if r.name == "hpc_rl.config"]
    for flag in ("--train-backend fsdp:", "--gradient-checkpointing:", "--attn-implementation flash_attention_3:",
                 "--fsdp-full-params:", "--fsdp-cpu-offload:", "--warmup-ratio 0.03:", "--fsdp-state-dict-cpu-offload:",
                 "--fsdp-cpu-backend gloo:"):
        assert sum(line.startswith(flag) for line in lines) == 1, (flag, lines)
    training = config.training
    assert (training.recompute_granularity, training.recompute_method, training.recompute_num_layers) == (
        "full", "uniform", 1)
    assert config.optimizer.optimizer_cpu_offload is True and config.optimizer.lr_warmup_fraction == 0.03
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hpc_rl.config"):
        load_config([], ["--train-backend", "megatron"])
    assert not [r for r in caplog.records if r.name == "hpc_rl.config"]  # hpc_rl's own behaviour: nothing to say


@pytest.mark.parametrize(("flags", "match"), [
    (["--fp16"], "--fp16 is refused: hpc_rl trains in bf16"),
    (["--deterministic-mode"], "--deterministic-mode is refused"),
    (["--use-pytorch-profiler"], "no built-in profiler"),
    (["--train-backend", "deepspeed"], "--train-backend 'deepspeed' is refused"),
    (["--attn-implementation", "paged"], "--attn-implementation 'paged' is refused"),
])
def test_fsdp_flags_refused_with_the_reason(flags: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config([], flags)


def test_qwen3_vl_8b_fsdp_line_dry_runs(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if "qwen3_vl" not in family_names():
        pytest.skip("needs the qwen3_vl model family (hpc_rl/models/qwen3_vl, issue 32's model half)")
    line = [*HEAD, *flags_of("qwen3_vl_8B_fsdp_rest.txt"), *MODEL]
    code = main([*line, "--dry-run", "--no-check-files", "--executor", "local"])
    out, err = capsys.readouterr()
    assert code == 0, err
    for flag in ("--train-backend fsdp:", "--gradient-checkpointing:", "--attn-implementation flash_attention_3:"):
        assert sum(flag in line for line in err.splitlines()) == 1, (flag, err)
    resolved = resolved_from_dry_run(out)
    rollout, training = resolved["rollout"], resolved["training"]
    assert rollout["multimodal_keys"] == {"image": "images"} and rollout["rm_type"] == "geo3k"
    assert rollout["apply_chat_template"] is True and rollout["update_weight_buffer_size"] == 512 * 1024 * 1024
    assert training["recompute_granularity"] == "full"
    assert resolved["model"] == "configs/models/qwen3_vl_8B.yaml"
    assert resolved["cluster"]["colocate"] is True
    assert "dry run: the config is valid" in out
