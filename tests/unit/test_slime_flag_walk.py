"""Issue 26: every flag of slime's arguments.py (hpc_rl/config/slime_arguments.tsv, with the slime commit it came
from) is either accepted (a config field with slime's meaning, or a behaviour hpc_rl always has) or refused with the
reason; none is an "unknown setting". Each flag is tried alone on top of the tiny config, as a slime user would
(`--dry-run --no-check-files`: load + validate without the file checks), in this process."""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hpc_rl.config import ConfigError
from hpc_rl.config.loading import Setting, build_config, parse_cli_settings, read_yaml_settings
from hpc_rl.config.help_text import slime_flag_status, submit_help
from hpc_rl.config.slime_flag_list import (
    GROUP_TITLES, SLIME_ARGUMENTS_LIST, SLIME_LATER_FLAGS, SLIME_LATER_VALUES, SlimeFlag, slime_flag_list,
    slime_list_source,
)
from hpc_rl.config.slime_flags import REMOVED_BY_SLIME
from hpc_rl.config.validation import collect_problems

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"
SLIME_MIRROR = Path("/work/.mirror/THUDM+slime/repo")

OWNED_ELSEWHERE: dict[str, str] = {}
"""slime flags other issues own, skipped by the walk (the lead removes them as those issues land)."""

TINY_MLA_MODEL = ["--model", "configs/models/tiny_deepseek_v3.yaml", "--hf-checkpoint", "assets/tiny_deepseek_v3"]
SAMPLES: dict[str, list[str]] = {
    "--rollout-storage-profile": ["local"],
    "--rollout-external-engine-addrs": ["10.0.0.5:30000"],
    "--rollout-num-gpus-per-engine": ["1"],
    "--offload": ["--colocate"],
    "--offload-train": ["--colocate"],
    "--rollout-batch-size": ["16"],
    "--n-samples-per-prompt": ["8"],
    "--global-batch-size": ["128"],
    "--num-steps-per-rollout": ["1"],
    "--over-sampling-batch-size": ["32"],
    "--use-dynamic-batch-size": ["--max-tokens-per-gpu", "256"],
    "--eps-clip-c": ["3.0"],
    "--rm-type": ["math"],
    "--eval-prompt-data": ["tiny", "data/tiny_copy_eval.jsonl"],
    "--dynamic-sampling-filter-path": ["hpc_rl.rollout.filters.check_reward_nonzero_std"],
    "--buffer-filter-path": ["hpc_rl.rollout.filters.pop_first"],
    "--custom-generate-function-path": ["tests.unit.plugin_fixtures.generate"],
    "--custom-rm-path": ["tests.unit.plugin_fixtures.reward"],
    "--custom-loss-function-path": ["tests.unit.plugin_fixtures.custom_loss", "--loss-type", "custom_loss"],
    "--custom-advantage-function-path": ["tests.unit.plugin_fixtures.custom_advantages"],
    "--use-tis": [],
    "--use-rollout-logprobs": [],
    "--update-weight-buffer-size": ["536870912"],
    "--custom-tis-function-path": ["tests.unit.plugin_fixtures.tis"],
    "--get-mismatch-metrics": ["--custom-tis-function-path", "tests.unit.plugin_fixtures.tis"],
    "--use-rollout-entropy": ["--custom-advantage-function-path", "tests.unit.plugin_fixtures.custom_advantages"],
    "--ref-update-interval": ["2", "--use-kl-loss"],
    "--ref-ckpt-step": ["1", "--ref-load", "/ckpt"],
    "--eval-reward-key": ["score", "--reward-key", "score"],
    "--eval-config": [str(REPO / "tests" / "unit" / "data" / "eval_config.yaml")],
    "--rollout-sample-hook-path": ["tests.unit.plugin_fixtures.sample_hook"],
    "--rollout-sample-filter-path": ["tests.unit.plugin_fixtures.groups_visitor"],
    "--rollout-all-samples-process-path": ["tests.unit.plugin_fixtures.all_samples_visitor"],
    "--custom-rollout-log-function-path": ["tests.unit.plugin_fixtures.rollout_log"],
    "--custom-eval-rollout-log-function-path": ["tests.unit.plugin_fixtures.eval_log"],
    "--custom-reward-post-process-path": ["tests.unit.plugin_fixtures.reward_post_process"],
    "--custom-megatron-init-path": ["tests.unit.plugin_fixtures.record_init"],
    "--custom-megatron-before-log-prob-hook-path": ["tests.unit.plugin_fixtures.record_log_prob_pass"],
    "--custom-megatron-before-train-step-hook-path": ["tests.unit.plugin_fixtures.record_train_step"],
    "--rollout-data-postprocess-path": ["tests.unit.plugin_fixtures.untrain_everything"],
    "--custom-model-provider-path": ["tests.unit.plugin_fixtures.tagged_model_provider"],
    "--model-name": ["qwen3"],
    "--use-routing-replay": ["--model", "configs/models/qwen3_30B_A3B.yaml", "--hf-checkpoint", "/m/Qwen3-30B-A3B"],
    "--use-rollout-routing-replay": ["--model", "configs/models/qwen3_30B_A3B.yaml", "--hf-checkpoint", "/m/Qwen3-30B-A3B"],
    "--update-weight-transport": ["disk", "--update-weight-disk-dir", "/shared/weights"],
    "--update-weight-mode": ["full"],
    "--update-weight-disk-dir": ["/shared/weights", "--update-weight-transport", "disk"],
    "--update-weight-disk-keep-files": ["--update-weight-transport", "disk", "--update-weight-disk-dir", "/w"],
    "--custom-update-weight-post-write-path": ["tests.unit.plugin_fixtures.record_post_write",
                                               "--update-weight-transport", "disk", "--update-weight-disk-dir", "/w"],
    "--debug-train-only": ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
                           "--loss-type", "sft_loss", "--n-samples-per-prompt", "1", "--global-batch-size", "16"],
    "--use-opd": ["--opd-type", "sglang", "--opd-teacher-hf-checkpoint", "assets/tiny_qwen3_teacher",
                  "--opd-teacher-num-gpus", "1"],
    "--opd-type": ["megatron", "--use-opd", "--opd-teacher-load", "/ckpt/teacher"],
    "--opd-teacher-load": ["/ckpt/teacher", "--use-opd", "--opd-type", "megatron"],
    "--opd-teacher-ckpt-step": ["3", "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/ckpt/teacher"],
    "--megatron-config-path": [str(REPO / "tests" / "unit" / "data" / "megatron_roles.yaml"),
                               "--advantage-estimator", "ppo"],
    # MTP: on the tiny DeepSeek-V3 (hpc_rl maps MTP layers for the MLA families; on the tiny Qwen3 it is an error)
    "--mtp-num-layers": ["1", *TINY_MLA_MODEL],
    "--enable-mtp-training": TINY_MLA_MODEL,
    "--freeze-indexer": ["--model", "configs/models/tiny_deepseek_v32.yaml", "--hf-checkpoint", "/m/DeepSeek-V3.2"],
    "--mtp-loss-scaling-factor": ["0.2", "--enable-mtp-training", *TINY_MLA_MODEL],
    "--balance-by-flops": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "256"],
    "--log-probs-max-tokens-per-gpu": ["512", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256"],
}
"""The value (and any companion flag slime's own checks ask for) a flag is tried with, where slime's default or a
value of its type is not one a run takes."""

WANDB_FLAGS = ("--wandb-mode", "--wandb-dir", "--wandb-key", "--wandb-host", "--wandb-team", "--wandb-group",
               "--wandb-project", "--wandb-run-id")


def sample_argv(flag: SlimeFlag) -> list[str]:
    """The flag with a value a run takes: SAMPLES', else slime's default, else one of its type."""
    if flag.flag in SAMPLES:
        return [flag.flag, *SAMPLES[flag.flag]]
    if flag.flag in WANDB_FLAGS:
        return [flag.flag, "offline" if flag.flag == "--wandb-mode" else "x", "--use-wandb"]
    if flag.kind == "switch":
        return [flag.flag]
    if flag.choices:
        return [flag.flag, flag.choices[0]]
    if flag.default and flag.default not in ("[]", "'{}'"):
        default = flag.default.strip("'")
        return [flag.flag, *(default.strip("[]").replace("'", "").split(", ") if default.startswith("[") else [default])]
    return [flag.flag, {"int": "2", "float": "0.5", "json": "{}"}.get(flag.type, "x")]


@functools.cache
def tiny_settings() -> tuple[Setting, ...]:
    """The tiny config's settings, read once (the walk builds ~220 configs on top of them)."""
    return tuple(read_yaml_settings(TINY))


def outcome(flag: SlimeFlag) -> tuple[str, str]:
    """('accepted', '') | ('refused', reason) | ('unknown' | 'problem', message) for the flag alone."""
    argv = sample_argv(flag)
    try:
        config = build_config([*tiny_settings(), *parse_cli_settings(argv)])  # = load_config([TINY], argv)
    except ConfigError as error:
        text = str(error)
        if "unknown setting" in text:
            return "unknown", text
        refused = [line for line in text.splitlines() if f"{flag.flag} " in line and "is refused:" in line]
        return ("refused", refused[0].split("is refused:", 1)[1].strip()) if refused else ("problem", text)
    problems = [str(p) for p in collect_problems(config, check_files=False)]
    if flag.flag == "--use-wandb" or "--use-wandb" in argv:  # needs the [wandb] extra where the job runs
        problems = [p for p in problems if "needs the wandb package" not in p or importlib.util.find_spec("wandb")]
    return ("accepted", "") if not problems else ("problem", "; ".join(problems))


def walked_flags() -> list[SlimeFlag]:
    return [flag for flag in slime_flag_list() if flag.flag not in OWNED_ELSEWHERE]


def test_no_slime_flag_is_unknown() -> None:
    results = {flag.flag: outcome(flag) for flag in walked_flags()}
    unknown = sorted(flag for flag, (kind, _) in results.items() if kind == "unknown")
    problems = {flag: message for flag, (kind, message) in results.items() if kind == "problem"}
    assert not unknown, f"{len(unknown)} slime flags are unknown settings: {unknown}"
    assert not problems, "flags that are neither accepted nor refused with a reason:\n" + "\n".join(
        f"{flag}: {message}" for flag, message in problems.items())
    assert all(len(reason) > 15 for kind, reason in results.values() if kind == "refused")


def test_the_walk_covers_slimes_whole_list() -> None:
    flags = slime_flag_list()
    assert len(flags) == 223 and len({f.flag for f in flags}) == 223
    assert set(OWNED_ELSEWHERE) <= {f.flag for f in flags}, "an owned flag left slime's list: drop it here"
    commit, date = slime_list_source()
    assert len(commit) == 40 and date == "2026-08-21"
    assert {f.group for f in flags} <= set(GROUP_TITLES)


def test_help_lists_every_slime_flag_in_its_group() -> None:
    text = submit_help("usage: test")
    section = text.split("slime's own flags (", 1)[1]
    for flag in slime_flag_list():
        assert f"\n  {flag.flag}: " in section, flag.flag
    assert f" {GROUP_TITLES['fault_tolerance']}:\n  --use-fault-tolerance: " in section
    assert "not known to hpc_rl yet" not in "".join(
        f"{f.flag}: {slime_flag_status(f.name)}\n" for f in walked_flags())


@pytest.mark.skipif(not SLIME_MIRROR.is_dir() or shutil.which("git") is None, reason="no slime checkout here")
def test_the_list_is_what_the_tool_reads_from_slime(tmp_path: Path) -> None:
    commit, _ = slime_list_source()
    out = tmp_path / "slime_arguments.tsv"
    subprocess.run(["python", str(REPO / "tools" / "list_slime_flags.py"), "--slime-repo", str(SLIME_MIRROR),
                    "--rev", commit, "--out", str(out)], check=True, capture_output=True)
    assert out.read_text() == SLIME_ARGUMENTS_LIST.read_text()


def _kinds() -> dict[str, Any]:
    return {flag.flag: outcome(flag)[0] for flag in walked_flags()}


# --- issue 34: the flags slime's main added after the list's commit, and the ones it removed ---------------------

LATER_ACCEPTED = {"--pg-loss-type", "--buffer-sort-by-staleness", "--flush-cache-interval",
                  "--force-fp8-ue8m0-scale", "--rollout-data-dir", "--rollout-storage-profile",
                  "--use-score-centering", "--score-centering-top-k", "--routing-replay-prefetch-microbatches",
                  "--rollout-session-id", "--rollout-cleanup-timeout"}
LATER_MODEL_SWITCHES = {"--post-self-attn-layernorm", "--post-mlp-layernorm"}
"""GLM4's sandwich norms: model flags hpc_rl reads already (they come together; the tiny Qwen3 has neither)."""
LATER_HYBRID_SWITCHES = {"--use-gated-attention"}
"""slime's name of the attention output gate (issue 31): a model switch of the hybrid families, a problem on the
tiny Qwen3 (which has no gate), naming the spec to add."""


def test_flags_slime_added_later_are_accepted_or_refused_with_a_reason() -> None:
    listed = {f.flag for f in slime_flag_list()}
    assert len(SLIME_LATER_FLAGS) == 20 and not listed & {f.flag for f in SLIME_LATER_FLAGS}
    assert {f.group for f in SLIME_LATER_FLAGS} <= set(GROUP_TITLES)
    results = {flag.flag: outcome(flag) for flag in SLIME_LATER_FLAGS}
    assert {flag for flag, (kind, _) in results.items() if kind == "accepted"} == LATER_ACCEPTED, results
    refused = {flag: reason for flag, (kind, reason) in results.items() if kind == "refused"}
    assert set(refused) == ({f.flag for f in SLIME_LATER_FLAGS} - LATER_ACCEPTED - LATER_MODEL_SWITCHES
                            - LATER_HYBRID_SWITCHES), results
    for flag in LATER_MODEL_SWITCHES:
        kind, message = results[flag]
        assert kind == "problem" and "come together (GLM4's sandwich norms)" in message
    for flag in LATER_HYBRID_SWITCHES:
        kind, message = results[flag]
        assert kind == "problem" and "get_qwen3_5_spec" in message, message
    assert all(len(reason) > 15 for reason in refused.values())
    assert "JuiceFS" in refused["--rollout-queue-lease-seconds"]
    assert "JuiceFS" in refused["--rollout-storage-declaration"]
    for flag in ("--rollout-queue-run-id", "--rollout-io-concurrency"):
        assert flag in {f.flag for f in SLIME_LATER_FLAGS} and refused[flag]


def test_values_slime_added_later_are_refused_with_a_reason() -> None:
    by_flag = {f.flag: f for f in slime_flag_list()}
    for flag, values in SLIME_LATER_VALUES.items():
        for value in values:
            with pytest.raises(ConfigError, match=f"{flag} '{value}' is refused: .*straw"):
                build_config([*tiny_settings(), *parse_cli_settings([by_flag[flag].flag, value])])


def test_flags_slime_removed_keep_their_answer() -> None:
    expected = {"--update-weights-interval": "accepted", "--keep-old-actor": "accepted",
                "--disable-rollout-global-dataset": "refused", "--profile-target": "refused"}
    assert {"--" + name.replace("_", "-") for name in REMOVED_BY_SLIME} == set(expected)
    by_flag = {f.flag: f for f in slime_flag_list()}
    assert {flag: outcome(by_flag[flag])[0] for flag in expected} == expected
    for name in REMOVED_BY_SLIME:
        assert slime_flag_status(name).endswith("[slime removed this flag after 2026-08-21; hpc_rl still takes it "
                                                 "from older launch lines]"), name
    section = submit_help("usage: test").split("slime's own flags (", 1)[1]
    assert "\n  --keep-old-actor: -> algorithm.keep_old_actor [slime removed" in section
    for flag in SLIME_LATER_FLAGS:
        assert f"\n  {flag.flag}: " in section, flag.flag


def test_pg_loss_type_is_a_checked_field() -> None:
    config = build_config([*tiny_settings(), *parse_cli_settings(["--pg-loss-type", "reinforce"])])
    assert config.algorithm.pg_loss_type == "reinforce"
    assert build_config(list(tiny_settings())).algorithm.pg_loss_type is None
    with pytest.raises((ConfigError, ValueError), match="pg_loss_type"):
        build_config([*tiny_settings(), *parse_cli_settings(["--pg-loss-type", "a2c"])])


def test_score_centering_is_a_checked_field() -> None:
    config = build_config([*tiny_settings(), *parse_cli_settings(["--use-score-centering",
                                                                  "--score-centering-top-k", "4"])])
    assert config.algorithm.use_score_centering and config.algorithm.score_centering_top_k == 4
    assert config.algorithm.pg_loss_type == "reinforce"  # slime's default loss under score centering
    with pytest.raises((ConfigError, ValueError), match="score_centering_top_k"):
        build_config([*tiny_settings(), *parse_cli_settings(["--use-score-centering", "--score-centering-top-k", "0"])])
    with pytest.raises((ConfigError, ValueError), match="pg_loss_type reinforce"):
        build_config([*tiny_settings(), *parse_cli_settings(["--use-score-centering", "--pg-loss-type", "ppo"])])


def test_storage_flags_that_map_onto_the_run_directory_are_accepted_and_juicefs_is_refused() -> None:
    config = build_config([*tiny_settings(), *parse_cli_settings(
        ["--rollout-data-dir", "/shared/juicefs/jobs/run/rollout_data", "--rollout-storage-profile", "local",
         "--force-fp8-ue8m0-scale"])])
    assert config.checkpoint.force_fp8_ue8m0_scale is True
    with pytest.raises(ConfigError, match="--rollout-storage-profile 'juicefs' is refused: .*JuiceFS"):
        build_config([*tiny_settings(), *parse_cli_settings(["--rollout-storage-profile", "juicefs"])])
    assert "run directory" in slime_flag_status("rollout_data_dir")
    assert slime_flag_status("rollout_data_dir").startswith("accepted (any value)")
