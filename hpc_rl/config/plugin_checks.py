"""The plug-in fields of the run config (slime's `--custom-*-path` flags), resolved at submit time.

Owns: which config field names which plug-in kind (`CONFIG_PLUGINS`; the signatures' home is
`hpc_rl.plugins.PLUGIN_KINDS`), and importing each given plug-in and checking its signature, so a typo fails at
submit rather than hours into a job. Called by `hpc_rl.config.validation.collect_problems`.
"""

from __future__ import annotations

from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.plugins import PluginError, load_plugin


CONFIG_PLUGINS = {"rollout.custom_rm_path": "reward", "rollout.dynamic_sampling_filter_path": "dynamic_sampling_filter",
                  "rollout.buffer_filter_path": "buffer_filter", "rollout.custom_generate_function_path": "generate",
                  "algorithm.custom_loss_function_path": "loss",
                  "algorithm.custom_advantage_function_path": "advantage",
                  "algorithm.custom_tis_function_path": "tis",
                  "rollout.rollout_sample_filter_path": "sample_filter",
                  "rollout.rollout_all_samples_process_path": "all_samples_process",
                  "rollout.custom_rollout_log_function_path": "rollout_log",
                  "eval.custom_eval_rollout_log_function_path": "eval_rollout_log",
                  "rollout.custom_reward_post_process_path": "reward_post_process",
                  "training.custom_megatron_init_path": "megatron_init",
                  "training.custom_megatron_before_log_prob_hook_path": "before_log_prob_hook",
                  "training.custom_megatron_before_train_step_hook_path": "before_train_step_hook",
                  "algorithm.rollout_data_postprocess_path": "rollout_data_postprocess",
                  "training.custom_model_provider_path": "model_provider",
                  "rollout.custom_update_weight_post_write_path": "update_weight_post_write"}
"""Config field (section.name) -> its kind in `hpc_rl.plugins.PLUGIN_KINDS` (the signatures' one home).
A field the schema does not have (yet) is skipped."""


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
