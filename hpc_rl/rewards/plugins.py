"""Custom reward functions named by `custom_rm_path`: loading, checking, caching.

Owns: what a reward plug-in must look like -- `async def fn(args, sample) -> float`, or with
`group_rm` `async def fn(args, samples) -> list[float]` (slime's signatures) -- and a cache so each
path is imported once per process. Path resolution (`pkg.module.fn`, `pkg.module:fn`,
`path/to/file.py:fn`) and the signatures are the shared `hpc_rl.plugins` (`PLUGIN_KINDS`),
so the config validator at submit time and the controller at run time agree. Every failure is a
`PluginError` naming the path and what to fix. It does not call the function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

from hpc_rl.plugins import PLUGIN_KINDS, PluginError, load_plugin

__all__ = ["PluginError", "RewardFunction", "expected_params", "load_reward_function"]

RewardFunction = Callable[[Any, Any], Coroutine[Any, Any, Any]]
"""`async fn(args, sample) -> float` or, in group mode, `async fn(args, samples) -> list[float]`."""


def expected_params(group: bool) -> list[str]:
    """The positional arguments hpc_rl passes (as slime does; `hpc_rl.plugins.PLUGIN_KINDS`)."""
    return list(PLUGIN_KINDS["group_reward" if group else "reward"].params)


@functools.cache
def load_reward_function(path: str, *, group: bool = False) -> RewardFunction:
    """Import and check a custom reward function (cached per path and mode)."""
    return load_plugin("group_reward" if group else "reward", path)
