"""The files of a checkpoint root, read and pruned without torch (submit, the driver and tests use them).

Owns the names (Megatron's tracker `latest_checkpointed_iteration.txt`, `iter_XXXXXXX/`, hpc_rl's
`hpc_rl_state.json`), reading which iteration is committed and what its state says, and
`prune_iterations` (`checkpoint.keep_last`: the oldest committed iterations go, never the tracker's).
Not here: writing and loading the tensors (`hpc_rl.training.checkpoint`, which imports torch).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "hpc_rl_state.json"
_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def iterations(root: str | Path) -> list[int]:
    """The iteration numbers of `root`'s iter_XXXXXXX dirs (not the unfinished `.tmp` ones), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)) for path in root.iterdir()
                   if (m := _ITERATION_DIR.match(path.name)) and path.is_dir()), reverse=True)


def tracker_iteration(root: str | Path) -> tuple[int | None, str | None]:
    """(the tracker's iteration, None) or (None, what is wrong with it); (None, None) when there is none."""
    tracker = Path(root) / TRACKER
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        return None, None
    except OSError as error:
        return None, f"{TRACKER} cannot be read ({error.strerror})"
    if text == "release":
        return 0, None
    try:
        return int(text), None
    except ValueError:
        return None, f"{TRACKER} holds {text[:20]!r}, not an iteration number"


def latest_iteration(root: str | Path) -> int | None:
    """The committed iteration of a checkpoint root, or None when there is none; ValueError naming the tracker
    when it cannot be read or holds no iteration number."""
    iteration, problem = tracker_iteration(root)
    if problem is not None:
        raise ValueError(f"{root}: {problem}")
    return iteration


def latest_state(root: str | Path) -> dict[str, Any] | None:
    """The committed checkpoint's `hpc_rl_state.json` (rollout_id, controller_state, ...); None when the
    root has no committed checkpoint or it holds weights only (what the HF converter writes)."""
    try:
        iteration = latest_iteration(root)
    except (OSError, ValueError):
        return None
    if iteration is None:
        return None
    try:
        state = json.loads((iteration_dir(root, iteration) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def prune_iterations(root: str | Path, keep_last: int) -> list[Path]:
    """Remove committed iteration dirs older than the newest `keep_last` (the tracker's is always kept);
    returns what was removed. Unfinished saves (`*.tmp`) are the saver's to clean."""
    root = Path(root)
    current = latest_iteration(root)
    found = [(iteration, iteration_dir(root, iteration)) for iteration in reversed(iterations(root))]
    kept = {iteration for iteration, _ in found[-max(1, keep_last):]} | {current}
    removed = []
    for iteration, path in found:
        if iteration not in kept and (current is None or iteration < current):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
