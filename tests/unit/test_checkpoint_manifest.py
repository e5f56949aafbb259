"""Checkpoints verified before they are trusted (issue 37, cases 1 and 2): the manifest written at commit, what makes
an iteration unusable (named by file), the newest whole one taken with ONE line saying what was skipped, a refusal
(exit 2 at submit, before anything starts) when none is whole, legacy checkpoints without a manifest, and the
rollout records a resume moves aside instead of deleting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.launch.run_attempts import check_resume, finished_already
from hpc_rl.training.checkpoint_files import STATE_FILE, TRACKER, iteration_dir
from hpc_rl.training.checkpoint_manifest import MANIFEST, check_iteration, choose_resume, write_manifest
from hpc_rl.telemetry.run_files import REDONE_RECORDS, drop_rollout_records_from

REPO = Path(__file__).resolve().parents[2]


def saved(root: Path, rollout_id: int, *, manifest: bool = True, commit: bool = True) -> Path:
    """The files a trainer's save leaves for rollout `rollout_id` (2 ranks; the tensors' bytes do not matter)."""
    directory = iteration_dir(root, rollout_id)
    (directory / "rng").mkdir(parents=True)
    for name in (".metadata", "metadata.json", "__0_0.distcp", "__1_0.distcp", "common.pt"):
        (directory / name).write_bytes(b"t" * 2000)
    for rank in (0, 1):
        (directory / "rng" / f"rank_{rank:05d}.pt").write_bytes(b"r" * 100)
    (directory / STATE_FILE).write_text(json.dumps({"rollout_id": rollout_id, "controller_state": {
        "next_rollout_id": rollout_id + 1}}))
    if manifest:
        write_manifest(directory)
    if commit:
        (root / TRACKER).write_text(str(rollout_id))
    return directory


DAMAGE = {
    "state file deleted (case 1)": (lambda d: (d / STATE_FILE).unlink(), f"{STATE_FILE} is missing"),
    "state file cut short": (lambda d: (d / STATE_FILE).write_text('{"rollout_id": 9, "contr'),
                             f"{STATE_FILE} has 24 bytes, the manifest says"),
    "a shard cut short": (lambda d: (d / "__0_0.distcp").write_bytes(b"t" * 10),
                          "__0_0.distcp has 10 bytes, the manifest says 2000"),
    ".metadata deleted": (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
    "metadata.json deleted": (lambda d: (d / "metadata.json").unlink(), "metadata.json is missing"),
    "a rank's rng file deleted": (lambda d: (d / "rng" / "rank_00001.pt").unlink(), "rng/rank_00001.pt is missing"),
}


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "legacy"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_is_skipped_naming_the_file(tmp_path: Path, damage: str, manifest: bool) -> None:
    saved(tmp_path, 7, manifest=manifest)
    latest = saved(tmp_path, 9, manifest=manifest)
    assert choose_resume(tmp_path).iteration == 9 and choose_resume(tmp_path).skipped_line() is None
    harm, said = DAMAGE[damage]
    harm(latest)
    problem = check_iteration(latest)
    if not manifest and damage == "a shard cut short":
        said = None  # legacy: a non-empty cut file cannot be told from a whole one (no sizes were written)
    if not manifest and damage == "a rank's rng file deleted":
        said = None
    if not manifest and damage == "state file cut short":
        said = f"{STATE_FILE} is not valid JSON (Unterminated string"
    if said is None:
        assert problem is None
        return
    assert problem is not None and said in problem, problem
    choice = choose_resume(tmp_path)
    assert choice.iteration == 7
    line = choice.skipped_line()
    assert line is not None and "\n" not in line
    assert line.startswith(f"resuming from {iteration_dir(tmp_path, 7)}; skipped iter_0000009: ") and said in line


def test_the_manifest_is_written_after_every_file_and_lists_their_sizes(tmp_path: Path) -> None:
    directory = saved(tmp_path, 3)
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["has_state"] is True
    assert manifest["files"]["__1_0.distcp"] == 2000 and manifest["files"]["rng/rank_00000.pt"] == 100
    assert MANIFEST not in manifest["files"]
    assert check_iteration(directory) is None
    (directory / MANIFEST).write_text('{"format": 1, "files": {"__0_0')  # the manifest itself cut short
    assert "hpc_rl_manifest.json is not valid JSON" in (check_iteration(directory) or "")


def test_an_unreadable_tracker_tries_every_iteration_and_above_the_tracker_is_not_committed(tmp_path: Path) -> None:
    saved(tmp_path, 5)
    saved(tmp_path, 7)
    saved(tmp_path, 9, commit=False)  # renamed, then killed before the tracker was replaced
    assert choose_resume(tmp_path).iteration == 7
    (tmp_path / TRACKER).write_text("")  # case 2: an empty tracker
    choice = choose_resume(tmp_path)
    assert choice.iteration == 9
    assert f"{TRACKER} holds '', not an iteration number" in (choice.skipped_line() or "")


def test_weights_only_dirs_of_the_converter_still_load(tmp_path: Path) -> None:
    directory = iteration_dir(tmp_path, 0)
    directory.mkdir(parents=True)
    for name in (".metadata", "metadata.json", "__0_0.distcp"):
        (directory / name).write_bytes(b"w" * 50)
    (tmp_path / TRACKER).write_text("0")
    assert choose_resume(tmp_path).iteration == 0  # legacy, no rng/: weights only, as the HF converter writes
    write_manifest(directory)
    assert choose_resume(tmp_path).iteration == 0


def tiny(tmp_path: Path, *flags: str):
    return load_config([REPO / "configs/tiny_cpu.yaml"], ["--run-dir", str(tmp_path), "--load", str(tmp_path / "ckpt"),
                                                         "--num-rollout", "20", *flags])


def test_no_whole_checkpoint_is_refused_naming_files_and_the_flags_to_continue(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    root = tmp_path / "ckpt"
    assert check_resume(tiny(tmp_path)) == (None, None)  # a new run
    saved(root, 7)
    (saved(root, 9) / STATE_FILE).unlink()
    (iteration_dir(root, 7) / "__1_0.distcp").write_bytes(b"")
    skipped, refusal = check_resume(tiny(tmp_path), "python -m hpc_rl.submit x.yaml")
    assert skipped is None and refusal is not None
    assert refusal.startswith(f"no usable checkpoint in {root}; nothing was started:")
    assert "iter_0000009: hpc_rl_state.json is missing" in refusal
    assert "iter_0000007: __1_0.distcp has 0 bytes, the manifest says 2000" in refusal
    assert "python -m hpc_rl.submit x.yaml --ckpt-step 9 --start-rollout-id 10" in refusal  # its weights are whole
    assert "--ckpt-step 7" not in refusal
    assert finished_already(tiny(tmp_path)) is None

    skipped, refusal = check_resume(tiny(tmp_path, "--ckpt-step", "9", "--start-rollout-id", "10"))
    assert (skipped, refusal) == (None, None)  # what the hint says: iteration 9's weights, from rollout 10
    skipped, refusal = check_resume(tiny(tmp_path, "--ckpt-step", "9"))  # its position is lost: not without asking
    assert refusal is not None and "iter_0000009 (checkpoint.ckpt_step): hpc_rl_state.json is missing" in refusal
    skipped, refusal = check_resume(tiny(tmp_path, "--start-rollout-id", "0"))  # asked: from the initial weights
    assert refusal is None and skipped is not None and skipped.endswith(
        "starting at rollout 0 from checkpoint.ref_load / hf_checkpoint as checkpoint.start_rollout_id asks")


def test_submit_exits_2_before_starting_anything(tmp_path: Path, monkeypatch, capsys) -> None:
    from hpc_rl.submit import main

    monkeypatch.chdir(REPO)
    root = tmp_path / "ckpt"
    (saved(root, 9) / STATE_FILE).unlink()
    code = main(["configs/tiny_cpu.yaml", "--executor", "local", "--run-dir", str(tmp_path), "--load", str(root)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "no usable checkpoint" in err and "iter_0000009: hpc_rl_state.json is missing" in err
    assert "--ckpt-step 9 --start-rollout-id 10" in err
    assert not (tmp_path / "logs").exists() and not (tmp_path / "config.resolved.yaml").exists()


def test_a_resume_moves_the_records_it_redoes_aside_never_deleting_them(tmp_path: Path) -> None:
    records = tmp_path / "rollouts.jsonl"
    records.write_text("".join(json.dumps({"rollout_id": i}) + "\n" for i in range(12)) + '{"rollout_id": 1')
    assert drop_rollout_records_from(records, 8) == 5  # 8..11 moved, the cut line dropped
    assert [json.loads(line)["rollout_id"] for line in records.read_text().splitlines()] == list(range(8))
    redone = tmp_path / REDONE_RECORDS
    assert [json.loads(line)["rollout_id"] for line in redone.read_text().splitlines()] == [8, 9, 10, 11]


def test_ckpt_step_gives_way_to_a_newer_whole_checkpoint_of_the_run_it_started(tmp_path: Path) -> None:
    from hpc_rl.training.checkpoint_manifest import resume_directory

    (saved(tmp_path, 9) / STATE_FILE).unlink()
    assert choose_resume(tmp_path, 9).iteration is None  # its position is lost
    assert resume_directory(tmp_path, 9, 10) == iteration_dir(tmp_path, 9)  # its weights, from rollout 10
    saved(tmp_path, 11)  # what that run saved next: a requeue with the same settings continues from it
    assert resume_directory(tmp_path, 9, 10) == iteration_dir(tmp_path, 11)
    assert choose_resume(tmp_path, 9).iteration == 11


def test_a_requeued_driver_refuses_before_starting_anything_and_names_what_it_skipped(tmp_path: Path, monkeypatch,
                                                                                         caplog) -> None:
    from hpc_rl.config import write_resolved_config
    from hpc_rl.launch.driver import _resume_refused

    monkeypatch.chdir(REPO)
    root = tmp_path / "ckpt"
    saved(root, 7)
    (saved(root, 9) / "metadata.json").unlink()
    write_resolved_config(tiny(tmp_path), tmp_path)
    with caplog.at_level("WARNING", logger="hpc_rl.driver"):
        assert _resume_refused(tmp_path) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"resuming from {iteration_dir(root, 7)}; skipped iter_0000009: metadata.json is missing (the manifest lists "
        "it, 2000 bytes)"]
    (iteration_dir(root, 7) / STATE_FILE).write_text("{")
    caplog.clear()
    with caplog.at_level("WARNING", logger="hpc_rl.driver"):
        assert _resume_refused(tmp_path) == 2
    assert "no usable checkpoint" in caplog.records[0].getMessage()
