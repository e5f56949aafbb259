"""Submitting into a run dir that already holds a run: finished already, or resumed with what settings.

Owns what `hpc_rl.submit` says and keeps before it starts anything in an existing run dir:
  - `finished_already(config)`: the checkpoint to resume from is at the last rollout, so there is nothing
    to do (said at once, no process started, no Slurm job queued);
  - `keep_previous_config(run_dir, config)`: the last attempt's `config.resolved.yaml` is kept as
    `config_history/attempt-<n>.yaml` before the new one replaces it, and the settings that changed are
    listed (a resume with another batch size or lr is then visible, not silent).
Not here: the lock that keeps two runs out of one run dir (`run_lock`), resuming itself (the trainer
loads the checkpoint, the controller its state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hpc_rl.config.loading import RESOLVED_CONFIG_NAME, config_to_dict, write_private_if_secret
from hpc_rl.config.schema import RunConfig
from hpc_rl.training.checkpoint_files import latest_state

CONFIG_HISTORY = "config_history"
SHOWN_CHANGES = 30


def planned_rollouts(config: RunConfig) -> int:
    """`num_rollout`, or what the controller derives from num_epoch and the prompt file's size."""
    if config.rollout.num_rollout is not None:
        return config.rollout.num_rollout
    from hpc_rl.controller.rollout_stack import load_prompts, num_rollouts

    return num_rollouts(config.rollout, len(load_prompts(config.rollout)[0]))


def finished_already(config: RunConfig) -> str | None:
    """The "nothing to do" message when `checkpoint.load` holds a checkpoint at the last rollout, else None."""
    if not config.checkpoint.load:
        return None
    state = latest_state(config.checkpoint.load)
    if state is None:
        return None
    controller_state = state.get("controller_state") or {}
    next_rollout = int(controller_state.get("next_rollout_id", int(state.get("rollout_id", -1)) + 1))
    total = planned_rollouts(config)
    if next_rollout < total:
        return None
    return (f"nothing to do: the checkpoint in {config.checkpoint.load} is already at rollout {next_rollout} of "
            f"{total} (this run finished before); raise num_rollout to train further, or use a new --run-dir "
            "for a new run. Nothing was started.")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """`section.field: old -> new` for every setting that differs (nested sections flattened)."""
    old, new = _flat(before), _flat(after)

    def shown(flat: dict[str, Any], key: str) -> str:
        value = flat.get(key, "(unset)")
        return "<a key, not shown>" if key == "logging.wandb_key" and value not in (None, "(unset)") else repr(value)

    return [f"{key}: {shown(old, key)} -> {shown(new, key)}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def keep_previous_config(run_dir: str | Path, config: RunConfig) -> str | None:
    """Before `config` replaces the run dir's resolved config: keep the old one and say what changed.
    Returns the lines to print (None in a new run dir)."""
    run_dir = Path(run_dir)
    previous = run_dir / RESOLVED_CONFIG_NAME
    if not previous.is_file():
        return None
    history = run_dir / CONFIG_HISTORY
    history.mkdir(exist_ok=True)
    attempt = len(list(history.glob("attempt-*.yaml"))) + 1
    kept = history / f"attempt-{attempt}.yaml"
    text = previous.read_text()
    write_private_if_secret(kept, text, secret=previous.stat().st_mode & 0o077 == 0)  # a W&B key stays 0600
    try:
        before = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        before = {}
    changes = config_changes(before, config_to_dict(config))
    where = f"attempt {attempt}'s config is kept as {kept.relative_to(run_dir)}"
    if not changes:
        return f"{run_dir} held an earlier attempt; same settings this time ({where})"
    shown = changes[:SHOWN_CHANGES] + ([f"... and {len(changes) - SHOWN_CHANGES} more"]
                                       if len(changes) > SHOWN_CHANGES else [])
    return (f"{run_dir} held an earlier attempt; {len(changes)} setting(s) changed since ({where}):\n"
            + "\n".join(f"  {line}" for line in shown))
