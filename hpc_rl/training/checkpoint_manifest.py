"""Whether a checkpoint iteration is whole, and which one a resume takes (torch-free: submit, the driver and the
trainer ranks all ask the same questions and get the same answers).

Owns:
  - `hpc_rl_manifest.json`, written by rank 0 into `iter_XXXXXXX.tmp/` after every rank's files are written
    (after the save's barrier) and before the rename that commits it: every file of the iteration with its
    size, and whether the iteration holds a run's position (`hpc_rl_state.json`) or weights only;
  - `check_iteration`: what is wrong with an iteration dir, naming the file ("__0_0.distcp has 10 bytes, the
    manifest says 4096"), or None when it is whole. An iteration saved before manifests existed (legacy) is
    checked for what can be: torch_dist's metadata files present and non-empty, every file non-empty, the state
    JSON present (when the trainer saved it: an `rng/` dir says so) and parseable;
  - `choose_resume`: the newest whole iteration at or below the tracker's (all iteration dirs when the tracker is
    unreadable), or the one `checkpoint.ckpt_step` names, with the iterations skipped and why.
Sizes, not checksums: a checksum reads every byte back (minutes for a large model); a cut or missing file, what a
killed save or a full disk leaves, shows in its size. Not here: writing the tensors (`hpc_rl.training.checkpoint`),
what the launch does with the choice (`hpc_rl.launch.run_attempts`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_rl.training.checkpoint_files import STATE_FILE, TRACKER, iteration_dir, iterations, tracker_iteration

MANIFEST = "hpc_rl_manifest.json"
MANIFEST_FORMAT = 1
TORCH_DIST_METADATA = (".metadata", "metadata.json")
"""torch.distributed.checkpoint's index and Megatron's; a torch_dist dir without them cannot be loaded."""


def _files(directory: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = Path(parent) / name
            relative = path.relative_to(directory).as_posix()
            if relative != MANIFEST:
                found[relative] = path.stat().st_size
    return found


def write_manifest(directory: str | Path) -> Path:
    """Rank 0, after every rank's files are in `directory` (the save's barrier), before the commit's rename."""
    directory = Path(directory)
    files = _files(directory)
    manifest = {"format": MANIFEST_FORMAT, "has_state": STATE_FILE in files, "files": dict(sorted(files.items()))}
    target = directory / MANIFEST
    tmp = target.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, target)
    return target


def _state_problem(directory: Path) -> str | None:
    try:
        state = json.loads((directory / STATE_FILE).read_text())
    except OSError:
        return f"{STATE_FILE} is missing"
    except ValueError as error:
        return f"{STATE_FILE} is not valid JSON ({error.msg} at byte {error.pos}: cut short?)"
    if not isinstance(state, dict) or "rollout_id" not in state:
        return f"{STATE_FILE} has no rollout_id"
    return None


def _check_with_manifest(directory: Path, manifest: dict[str, Any], need_state: bool) -> str | None:
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        return f"{MANIFEST} lists no files"
    for name, size in listed.items():
        if name == STATE_FILE and not need_state:
            continue
        path = directory / name
        try:
            actual = path.stat().st_size
        except OSError:
            return f"{name} is missing (the manifest lists it, {size} bytes)"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    if manifest.get("has_state") and need_state:
        return _state_problem(directory)
    return None


def _check_legacy(directory: Path, need_state: bool) -> str | None:
    for name in TORCH_DIST_METADATA:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing (no {MANIFEST}: saved before manifests; its torch_dist index is required)"
    for name, size in sorted(_files(directory).items()):
        if size == 0 and (need_state or name != STATE_FILE):
            return f"{name} is empty"
    if not need_state:
        return None
    if (directory / STATE_FILE).exists() or (directory / "rng").is_dir():  # the trainer's save writes both
        return _state_problem(directory)
    return None


def check_iteration(directory: str | Path, *, need_state: bool = True) -> str | None:
    """What makes `directory` (an iter_XXXXXXX dir) unusable, naming the file; None when it is whole.
    `need_state` False: its weights are enough (a run that starts afresh from them: `start_rollout_id`)."""
    directory = Path(directory)
    if not directory.is_dir():
        return "the directory is missing"
    try:
        text = (directory / MANIFEST).read_text()
    except FileNotFoundError:
        return _check_legacy(directory, need_state)
    except OSError as error:
        return f"{MANIFEST} cannot be read ({error.strerror})"
    try:
        manifest = json.loads(text)
    except ValueError:
        return f"{MANIFEST} is not valid JSON (cut short?)"
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not a JSON object"
    return _check_with_manifest(directory, manifest, need_state)


def holds_position(directory: str | Path) -> bool:
    """Whether a whole iteration carries a run's position (hpc_rl_state.json), not weights only."""
    return (Path(directory) / STATE_FILE).is_file()


@dataclass
class ResumeChoice:
    """What a resume from a checkpoint root takes; `iteration` None: nothing usable (see `skipped`)."""

    root: Path
    iteration: int | None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(what, why) of each iteration passed over (and the tracker, when it is unreadable), newest first."""

    @property
    def directory(self) -> Path | None:
        return None if self.iteration is None else iteration_dir(self.root, self.iteration)

    @property
    def exists(self) -> bool:
        """Whether the root holds any checkpoint at all (usable or not)."""
        return self.iteration is not None or bool(self.skipped)

    def skipped_line(self) -> str | None:
        """ONE line: which iterations were skipped and why (None when none was)."""
        if not self.skipped:
            return None
        reasons = "; ".join(f"{what}: {why}" for what, why in self.skipped)
        taken = f"resuming from {self.directory}" if self.directory else "no usable checkpoint"
        return f"{taken}; skipped {reasons}"


def choose_resume(root: str | Path, ckpt_step: int | None = None, *, weights_only: bool = False) -> ResumeChoice:
    """The newest whole iteration of `root` at or below the tracker's; with `ckpt_step`, the newest whole one
    above it (a run's own later position wins, so a requeued attempt of a run started from `ckpt_step` continues
    where it stopped, as with start_rollout_id), else iteration `ckpt_step` (`weights_only`: its weights are
    enough, its state file may be lost)."""
    root = Path(root)
    if ckpt_step is not None:
        newer = _choose_newest(root, above=ckpt_step)
        if newer.iteration is not None:
            return newer
        problem = check_iteration(iteration_dir(root, ckpt_step), need_state=not weights_only)
        if problem is None:
            return ResumeChoice(root, ckpt_step, newer.skipped)
        return ResumeChoice(root, None, [*newer.skipped,
                                         (iteration_dir(root, ckpt_step).name + " (checkpoint.ckpt_step)", problem)])
    return _choose_newest(root)


def _choose_newest(root: Path, above: int = -1) -> ResumeChoice:
    found = [i for i in iterations(root) if i > above]
    committed, tracker_problem = tracker_iteration(root)
    skipped: list[tuple[str, str]] = []
    if tracker_problem is not None:
        skipped.append((TRACKER, f"{tracker_problem}; every iteration dir was tried"))
    elif committed is not None and committed > above:
        if committed not in found:
            skipped.append((iteration_dir(root, committed).name, f"the directory {TRACKER} names is missing"))
        found = [i for i in found if i <= committed]  # above the tracker: renamed, never committed
    for iteration in found:
        problem = check_iteration(iteration_dir(root, iteration))
        if problem is None:
            return ResumeChoice(root, iteration, skipped)
        skipped.append((iteration_dir(root, iteration).name, problem))
    return ResumeChoice(root, None, skipped)


def resume_directory(load: str | Path, ckpt_step: int | None, start_rollout_id: int | None) -> Path | None:
    """What a trainer resumes from: `choose_resume`'s directory (checkpoint.ckpt_step, and its weights only when
    start_rollout_id is given too); None: nothing to resume (a new run; also when no checkpoint is whole and the
    user asked for a start with start_rollout_id)."""
    choice = choose_resume(load, ckpt_step, weights_only=ckpt_step is not None and start_rollout_id is not None)
    if choice.directory is None and choice.exists and start_rollout_id is None:
        raise FileNotFoundError(f"{load}: {choice.skipped_line()}")
    return choice.directory


def usable_directory(root: str | Path) -> Path | None:
    """The directory a resume from `root` loads (None: `root` holds no iteration); raises FileNotFoundError naming
    the files when it holds iterations but none is whole."""
    choice = choose_resume(root)
    if choice.directory is None and choice.exists:
        raise FileNotFoundError(f"{root}: {choice.skipped_line()}")
    return choice.directory
