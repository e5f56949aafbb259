"""Submitting into a run dir that already holds a run: finished already, resumed from which checkpoint, or
refused, and with what settings.

Owns what `hpc_rl.submit` and the driver say and keep before they start anything in an existing run dir:
  - `check_resume(config)`: which checkpoint iteration a resume takes (`checkpoint_manifest.choose_resume`: the
    newest whole one) with ONE line naming those skipped and why, or the refusal when `checkpoint.load` holds
    checkpoints and none is whole (exit 2 before any process starts, naming the files and the flags that
    continue from a given iteration): a run with checkpoints never starts over from rollout 0 by itself;
  - `finished_already(config)`: the checkpoint to resume from is at the last rollout, so there is nothing
    to do (said at once, no process started, no Slurm job queued);
  - `keep_previous_config(run_dir, config)`: the last attempt's `config.resolved.yaml` is kept as
    `config_history/attempt-<n>.yaml` before the new one replaces it, and the settings that changed are
    listed (a resume with another batch size or lr is then visible, not silent).
Not here: the lock that keeps two runs out of one run dir (`run_lock`), resuming itself (the trainer
loads the checkpoint, the controller its state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from hpc_rl.config.loading import RESOLVED_CONFIG_NAME, config_to_dict, write_private_if_secret
from hpc_rl.config.schema import RunConfig
from hpc_rl.training.checkpoint_files import STATE_FILE, iteration_dir
from hpc_rl.training.checkpoint_manifest import ResumeChoice, check_iteration, choose_resume, iterations

CONFIG_HISTORY = "config_history"
SHOWN_CHANGES = 30


def planned_rollouts(config: RunConfig) -> int:
    """`num_rollout`, or what the controller derives from num_epoch and the prompt file's size."""
    if config.rollout.num_rollout is not None:
        return config.rollout.num_rollout
    from hpc_rl.controller.rollout_stack import load_prompts, num_rollouts

    return num_rollouts(config.rollout, len(load_prompts(config.rollout)[0]))


def resume_choice(config: RunConfig) -> ResumeChoice | None:
    """What a resume from `checkpoint.load` takes (None: no load dir)."""
    checkpoint = config.checkpoint
    if not checkpoint.load:
        return None
    weights_only = checkpoint.ckpt_step is not None and checkpoint.start_rollout_id is not None
    return choose_resume(checkpoint.load, checkpoint.ckpt_step, weights_only=weights_only)


def _continue_hints(root: str, command: str) -> list[str]:
    """`--ckpt-step N --start-rollout-id N+1` for each iteration whose weights are whole (newest first)."""
    return [f"{command} --ckpt-step {i} --start-rollout-id {i + 1}" for i in iterations(root)
            if check_iteration(iteration_dir(root, i), need_state=False) is None][:3]


def check_resume(config: RunConfig, command: str = "the same command with") -> tuple[str | None, str | None]:
    """(the line saying which checkpoints a resume skipped and why, or None; the refusal when `checkpoint.load`
    holds checkpoints and none is whole, or None). `command`: how the user ran it (the hints extend it)."""
    choice = resume_choice(config)
    if choice is None or choice.iteration is not None or not choice.exists:
        return (choice.skipped_line() if choice is not None else None), None
    load = config.checkpoint.load or ""
    start = config.checkpoint.start_rollout_id
    if start is not None and config.checkpoint.ckpt_step is None:  # asked for: a start without the checkpoints
        return (f"{choice.skipped_line()}; starting at rollout {start} from checkpoint.ref_load / hf_checkpoint "
                "as checkpoint.start_rollout_id asks"), None
    lines = [f"no usable checkpoint in {load}; nothing was started:"]
    lines += [f"  {what}: {why}" for what, why in choice.skipped]
    hints = _continue_hints(load, command)
    if hints:
        lines.append("To continue from the weights of an iteration (its rollout records kept, the optimizer and data "
                     f"cursor afresh when its {STATE_FILE} is lost), run:")
        lines += [f"  {hint}" for hint in hints]
    lines.append("Or restore the named files and run the same command again; or start a new run in a new --run-dir "
                 f"(or here, from the initial weights: {command} --start-rollout-id 0; rollouts.jsonl's records "
                 "it redoes are kept in rollouts.redone.jsonl).")
    return None, "\n".join(lines)


def finished_already(config: RunConfig) -> str | None:
    """The "nothing to do" message when `checkpoint.load` holds a checkpoint at the last rollout, else None."""
    choice = resume_choice(config)
    if choice is None or choice.directory is None:
        return None
    try:
        state = json.loads((choice.directory / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None  # weights only
    if not isinstance(state, dict):
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
