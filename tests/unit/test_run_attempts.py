"""Submitting into a run dir that held a run (issue 24): a finished one says "nothing to do" without starting
anything; a resumed one keeps the earlier attempt's config and lists what changed; NaN/inf refused at submit;
batch-size hints that divide; SIGTERM's grace read from Slurm's KillWait."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rl.config import load_config, write_resolved_config
from hpc_rl.config.validation import ValidationFailed, validate
from hpc_rl.launch.signals import slurm_kill_wait_s, term_grace_s
from hpc_rl.launch.run_attempts import CONFIG_HISTORY, config_changes, finished_already, keep_previous_config
from hpc_rl.training.checkpoint_files import STATE_FILE, TRACKER, iteration_dir, prune_iterations
from hpc_rl.training.checkpoint_manifest import write_manifest

REPO = Path(__file__).resolve().parents[2]


def tiny(tmp_path: Path, *flags: str):
    return load_config([REPO / "configs/tiny_cpu.yaml"], ["--run-dir", str(tmp_path), *flags])


def fake_checkpoint(root: Path, rollout_id: int) -> None:
    """The files a committed checkpoint leaves (what submit reads; the tensors do not matter here)."""
    directory = iteration_dir(root, rollout_id)
    directory.mkdir(parents=True)
    (directory / STATE_FILE).write_text(json.dumps({"rollout_id": rollout_id,
                                                    "controller_state": {"next_rollout_id": rollout_id + 1}}))
    for name in (".metadata", "metadata.json", "__0_0.distcp"):
        (directory / name).write_bytes(b"x" * 64)
    write_manifest(directory)
    (root / TRACKER).write_text(str(rollout_id))


def test_a_finished_run_dir_has_nothing_to_do(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    config = tiny(tmp_path, "--num-rollout", "4", "--load", str(tmp_path / "ckpt"))
    assert finished_already(config) is None  # no checkpoint yet
    fake_checkpoint(tmp_path / "ckpt", 2)
    assert finished_already(config) is None  # at rollout 3 of 4
    fake_checkpoint(tmp_path / "ckpt", 3)
    said = finished_already(config)
    assert said is not None and "nothing to do" in said and "already at rollout 4 of 4" in said


def test_a_resume_keeps_each_attempts_config_and_lists_the_changes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    first = tiny(tmp_path)
    assert keep_previous_config(tmp_path, first) is None  # a new run dir
    write_resolved_config(first, tmp_path)
    second = tiny(tmp_path, "--lr", "1e-3", "--rollout-batch-size", "8", "--global-batch-size", "64")
    said = keep_previous_config(tmp_path, second)
    assert said is not None and "4 setting(s) changed" in said and "config_history/attempt-1.yaml" in said  # + over_sampling_batch_size
    assert "optimizer.lr: 0.0005 -> 0.001" in said and "rollout.rollout_batch_size: 16 -> 8" in said
    assert (tmp_path / CONFIG_HISTORY / "attempt-1.yaml").read_text() == (tmp_path / "config.resolved.yaml").read_text()
    assert config_changes({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == ["a.c: '(unset)' -> 2"]


def test_nonfinite_numbers_are_refused_at_submit_and_hints_divide(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    try:
        validate(tiny(tmp_path, "--lr", "inf", "--rollout-temperature", "nan"), check_files=False)
    except ValidationFailed as failure:
        text = str(failure)
    assert "optimizer.lr: inf is not a finite number" in text and "rollout.rollout_temperature: nan" in text
    try:
        validate(tiny(tmp_path, "--num-steps-per-rollout", "3", "--global-batch-size", "42"), check_files=False)
    except ValidationFailed as failure:
        text = str(failure)
    assert "set global_batch_size x num_steps_per_rollout to one of 128 x 1, 64 x 2, 32 x 4" in text
    assert "set global_batch_size to 42" not in text  # the old hint: 42 * 3 is not 128
    try:
        validate(tiny(tmp_path, "--rollout-batch-size", "-1"), check_files=False)
    except ValidationFailed as failure:
        text = str(failure)
    assert "-8" in text and "set global_batch_size to" not in text  # no hint from an invalid size


def test_keep_last_removes_only_older_committed_checkpoints(tmp_path: Path) -> None:
    for rollout_id in (1, 3, 5, 7):
        fake_checkpoint(tmp_path, rollout_id)
    (tmp_path / "iter_0000009.tmp").mkdir()  # a save in progress is not the pruner's
    removed = prune_iterations(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["iter_0000001", "iter_0000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", "iter_0000007", "iter_0000009.tmp", TRACKER]


def test_sigterm_grace_comes_from_slurms_kill_wait() -> None:
    assert slurm_kill_wait_s("MinJobAge = 300 sec\nKillWait                = 5 sec\n") == 5.0
    assert slurm_kill_wait_s("") == 30.0  # Slurm's default
    assert term_grace_s(local=True) == 10.0


def test_numbers_past_float32_are_refused_at_submit_naming_the_field(tmp_path: Path, monkeypatch) -> None:
    """`--lr 1e39` is finite, so it passed submit and failed inside torch's AdamW ("cannot be converted to type
    float without overflow", no field named)."""
    monkeypatch.chdir(REPO)
    with pytest.raises(ValidationFailed) as refused:
        validate(tiny(tmp_path, "--lr", "1e39", "--set", "controller.engine_admin_timeout=1e300"), check_files=False)
    text = str(refused.value)
    assert "optimizer.lr: 1e+39 is beyond float32's range (+-3.403e+38)" in text
    assert "controller.engine_admin_timeout: 1e+300 is beyond float32's range" in text
    validate(tiny(tmp_path, "--lr", "3e38"), check_files=False)  # the edge itself is a number float32 holds
