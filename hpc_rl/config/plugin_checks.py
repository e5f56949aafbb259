"""The plug-in fields of the run config (slime's `--custom-*-path` flags), resolved at submit time.

Owns: importing each given plug-in and checking its signature, so a typo fails at submit rather than hours into a
job; which config field names which plug-in kind (`CONFIG_PLUGINS`) is read from the one table of plug-in points,
`hpc_rl.plugins.PLUGIN_KINDS`. Called by `hpc_rl.config.validation.collect_problems`.
"""

from __future__ import annotations

import re

from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.plugins import PLUGIN_KINDS, PluginError, load_plugin

REPEATED_KINDS = ("sample_hook",)
"""Kinds whose field is a list of paths (slime's repeatable --rollout-sample-hook-path)."""


CONFIG_PLUGINS: dict[str, str] = {spec.setting: kind for kind, spec in PLUGIN_KINDS.items()
                                  if re.fullmatch(r"\w+\.\w+", spec.setting) and kind not in REPEATED_KINDS}
"""Config field (section.name) -> its kind, read from `hpc_rl.plugins.PLUGIN_KINDS` (each kind's `setting`: the one
table of plug-in points and their fields); a kind named by a list field (`REPEATED_KINDS`) or by another kind's
field (group_reward: custom_rm_path with group_rm) is checked on its own. A field the schema does not have (yet) is
skipped."""


def plugin_problems(config: RunConfig) -> list[Problem]:
    problems = []
    for path in config.rollout.rollout_sample_hook_path:  # slime's repeatable --rollout-sample-hook-path
        try:
            load_plugin("sample_hook", path)
        except PluginError as error:
            problems.append(Problem("rollout.rollout_sample_hook_path", "plugin", str(error)))
    for setting, kind in CONFIG_PLUGINS.items():
        section, name = setting.split(".")
        path = getattr(getattr(config, section), name, None)
        if not path:
            continue
        if kind == "reward" and config.rollout.group_rm:
            kind = "group_reward"
        try:
            load_plugin(kind, path)
        except PluginError as error:
            problems.append(Problem(setting, "plugin", str(error)))
    return problems
