"""Plug-in signatures have one home (`hpc_rl.plugins.PLUGIN_KINDS`): a plug-in that passes the config
validation at submit time is one the job's loader accepts, and one the loader refuses fails validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.plugin_checks import CONFIG_PLUGINS
from hpc_rl.config.validation import collect_problems
from hpc_rl.plugins import PLUGIN_KINDS, PluginError
from hpc_rl.rewards.plugins import load_reward_function
from hpc_rl.rollout.filters import load_buffer_filter, load_group_filter
from hpc_rl.rollout.generate import load_generate_function

LOADERS = {
    "rollout.custom_rm_path": load_reward_function,
    "rollout.dynamic_sampling_filter_path": load_group_filter,
    "rollout.buffer_filter_path": load_buffer_filter,
    "rollout.custom_generate_function_path": load_generate_function,
}
"""What the running job calls to load each rollout plug-in."""


@pytest.fixture
def plugin_file(tmp_path: Path) -> Path:
    """For each kind, one function with its parameters in each flavour (plain and async)."""
    lines = []
    for kind, spec in PLUGIN_KINDS.items():
        params = ", ".join(spec.params)
        lines += [f"def plain_{kind}({params}):\n    return None\n",
                  f"async def async_{kind}({params}):\n    return None\n"]
    path = tmp_path / "plugins_of_every_kind.py"
    path.write_text("\n".join(lines))
    return path


@pytest.mark.parametrize("field", sorted(LOADERS))
@pytest.mark.parametrize("flavour", ["plain", "async"])
def test_validation_and_the_job_agree_on_every_rollout_plugin(in_repo: Path, plugin_file: Path, field: str,
                                                              flavour: str) -> None:
    kind = CONFIG_PLUGINS[field]
    path = f"{plugin_file}:{flavour}_{kind}"
    config = load_config([in_repo / "configs/tiny_cpu.yaml"], ["--set", f"{field}={path}"])
    refused_at_submit = any(p.where == field for p in collect_problems(config, check_files=False))
    try:
        LOADERS[field](path)
        refused_in_the_job = False
    except PluginError:
        refused_in_the_job = True
    assert refused_at_submit == refused_in_the_job, (
        f"{path}: validation {'refuses' if refused_at_submit else 'accepts'} it, the job's loader "
        f"{'refuses' if refused_in_the_job else 'accepts'} it")


def test_an_async_dynamic_sampling_filter_is_refused_at_submit_time(in_repo: Path, plugin_file: Path) -> None:
    """The scheduler calls the filter without awaiting it; validation used to accept `async def` (the job then
    failed when the controller loaded it, after the queue wait)."""
    path = f"{plugin_file}:async_dynamic_sampling_filter"
    config = load_config([in_repo / "configs/tiny_cpu.yaml"], ["--dynamic-sampling-filter-path", path])
    problems = [str(p) for p in collect_problems(config, check_files=False)
                if p.where == "rollout.dynamic_sampling_filter_path"]
    assert problems and "plain (non-async) function" in problems[0]
