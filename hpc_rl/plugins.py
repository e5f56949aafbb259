"""Resolve user plug-ins named by import path, and check them before a job runs.

Owns: turning a string such as ``"my_pkg.rewards.score"``, ``"my_pkg.rewards:score"`` or
``"path/to/file.py:score"``, ``"path/to/file.py.score"`` (or ``"my_rewards.score"`` naming ./my_rewards.py
when no such module is importable) into a callable, and checking that it can be called the way hpc_rl
will call it (positional parameter count, optionally names, optionally ``async def``).

Also owns which plug-in points exist and how hpc_rl calls each one (`PLUGIN_KINDS`, slime's
signatures): the config validator at submit time and every loader at run time read that one table
(`load_plugin`), so what passes validation is what loads in the job. slime resolves plug-ins lazily,
so a typo fails hours into a job; hpc_rl loads every configured plug-in at submit time on the login node.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PLUGIN_KINDS", "PluginError", "PluginKind", "load_callable", "load_plugin", "split_plugin_path"]


@dataclass(frozen=True)
class PluginKind:
    """One plug-in point: where its path is set, and how hpc_rl calls what it names."""

    setting: str
    """The config field (section.name) or flag that names the plug-in; error messages start with it."""
    params: tuple[str, ...]
    """The positional arguments hpc_rl passes, in order (slime's names)."""
    is_async: bool | None
    """True: must be `async def`; False: must be a plain function; None: either."""
    keywords: tuple[str, ...] = ()
    """The arguments hpc_rl passes by name (slime calls some plug-ins with keywords only): each must be a
    parameter of the function, or it takes **kwargs."""


PLUGIN_KINDS: dict[str, PluginKind] = {
    # -> float
    "reward": PluginKind("rollout.custom_rm_path", ("args", "sample"), True),
    # -> list[float], one per sample
    "group_reward": PluginKind("rollout.custom_rm_path (group_rm)", ("args", "samples"), True),
    # -> bool, or slime's DynamicFilterOutput(keep, reason)
    "dynamic_sampling_filter": PluginKind("rollout.dynamic_sampling_filter_path", ("args", "samples"), False),
    # -> the groups taken out of `buffer`
    "buffer_filter": PluginKind("rollout.buffer_filter_path", ("args", "rollout_id", "buffer", "num_samples"), False),
    # -> the sample, generated
    "generate": PluginKind("rollout.custom_generate_function_path", ("args", "sample", "sampling_params"), True),
    # -> (loss, metrics)
    "loss": PluginKind("algorithm.custom_loss_function_path", ("args", "batch", "logits", "sum_of_sample_mean"),
                       False),
    # -> None: fills rollout_data["advantages"] and ["returns"]
    "advantage": PluginKind("algorithm.custom_advantage_function_path", ("args", "rollout_data"), False),
    # -> Sample | None (after generation, before the reward); rollout_id= and evaluation= if it names them
    "sample_hook": PluginKind("rollout.rollout_sample_hook_path", ("args", "sample"), None),
    # -> None: marks sample.remove_sample on the kept groups
    "sample_filter": PluginKind("rollout.rollout_sample_filter_path", ("args", "samples"), False),
    # -> None: every scored group of the rollout, dropped ones included
    "all_samples_process": PluginKind("rollout.rollout_all_samples_process_path",
                                      ("args", "all_samples", "data_source"), False),
    # -> bool: skip hpc_rl's rollout/* scalars
    "rollout_log": PluginKind("rollout.custom_rollout_log_function_path",
                              ("rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"), False),
    # -> bool: skip hpc_rl's eval/* scalars
    "eval_rollout_log": PluginKind("eval.custom_eval_rollout_log_function_path",
                                   ("rollout_id", "args", "data", "extra_metrics"), False),
    # -> (raw_rewards, rewards): replaces the group normalisation of the rewards
    "reward_post_process": PluginKind("rollout.custom_reward_post_process_path", ("args", "samples"), False),
    # trainer ranks: -> None, after the process groups are up
    "megatron_init": PluginKind("training.custom_megatron_init_path", ("args",), False),
    # trainer ranks: -> None, before each log-prob pass ("" old, "ref_" reference)
    "before_log_prob_hook": PluginKind("training.custom_megatron_before_log_prob_hook_path",
                                       ("args", "model", "store_prefix"), False),
    # trainer ranks: -> None, before each optimizer step's forward/backward
    "before_train_step_hook": PluginKind("training.custom_megatron_before_train_step_hook_path",
                                         ("args", "rollout_id", "step_id", "model", "optimizer",
                                          "opt_param_scheduler"), False),
    # trainer ranks: -> None, may change rollout_data["loss_masks"] / ["advantages"] before training
    "rollout_data_postprocess": PluginKind("algorithm.rollout_data_postprocess_path",
                                           ("args", "rollout_id", "rollout_data"), False),
    # trainer ranks: -> this rank's GPTModel (pre_process, post_process by keyword; vp_stage too if it names it)
    "model_provider": PluginKind("training.custom_model_provider_path", (), False,
                                 keywords=("pre_process", "post_process")),
    # trainer ranks: -> None, after a disk weight sync's files are written (publish them on a non-POSIX filesystem)
    "update_weight_post_write": PluginKind("rollout.custom_update_weight_post_write_path",
                                           ("args", "version_dir", "rollout_engines"), False),
    # -> (pg_loss, loss_masks, metrics): slime calls it with keywords only
    "tis": PluginKind("algorithm.custom_tis_function_path", (), False,
                      keywords=("args", "pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks",
                                "total_lengths", "response_lengths")),
}
"""Every plug-in point hpc_rl calls, by kind."""


def load_plugin(kind: str, path: str, *, base_dir: str | None = None) -> Callable[..., Any]:
    """The callable `path` names, checked against `PLUGIN_KINDS[kind]` (raises PluginError naming the setting)."""
    spec = PLUGIN_KINDS[kind]
    return load_callable(path, list(spec.params), require_async=spec.is_async, base_dir=base_dir, what=spec.setting,
                         keywords=spec.keywords)


class PluginError(ValueError):
    """A plug-in path that cannot be imported, is not callable, or has the wrong signature."""


def split_plugin_path(path: str) -> tuple[str, str]:
    """Split a plug-in path into ``(module_or_file, attribute)``.

    ``"a.b.fn"`` -> ``("a.b", "fn")``; ``"a.b:fn"`` -> ``("a.b", "fn")``;
    ``"dir/file.py:fn"`` -> ``("dir/file.py", "fn")``. The attribute may be dotted (``"mod:Cls.method"``).
    """
    text = path.strip()
    if not text:
        raise PluginError("plug-in path is empty: expected 'package.module.function' or 'file.py:function'")
    if ":" in text:
        # rsplit keeps Windows drive letters ("C:\\x.py:fn") in the file part.
        target, _, attr = text.rpartition(":")
        if not target or not attr:
            raise PluginError(f"plug-in path {path!r}: expected 'module:function' or 'file.py:function'")
        return target, attr
    if ".py." in text:  # slime-style "path/to/file.py.function"
        target, _, attr = text.rpartition(".py.")
        return f"{target}.py", attr
    if text.endswith(".py"):
        raise PluginError(
            f"plug-in path {path!r}: a file path needs the function name, e.g. '{text}:my_function'"
        )
    module, _, attr = text.rpartition(".")
    if not module:
        raise PluginError(f"plug-in path {path!r}: expected a dotted path 'package.module.function'")
    return module, attr


def _import_file(file_path: str, original: str, base_dir: str | None) -> Any:
    resolved = file_path if os.path.isabs(file_path) else os.path.join(base_dir or os.getcwd(), file_path)
    resolved = os.path.abspath(resolved)
    if not os.path.isfile(resolved):
        raise PluginError(f"plug-in path {original!r}: file {resolved} does not exist")
    # A stable, unique module name so two files called rewards.py do not collide.
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:12]
    name = f"hpc_rl_plugin_{os.path.splitext(os.path.basename(resolved))[0]}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise PluginError(f"plug-in path {original!r}: cannot load {resolved} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        del sys.modules[name]
        raise PluginError(f"plug-in path {original!r}: {resolved} imports {exc.name!r}, which is not installed; "
                          f"install it where the job runs") from exc
    except Exception as exc:
        del sys.modules[name]
        raise PluginError(f"plug-in path {original!r}: importing {resolved} failed: {exc!r}") from exc
    return module


def _module_file(module_name: str, base_dir: str | None) -> str | None:
    """`a.b` -> `<base_dir or cwd>/a/b.py` when that file exists (slime users run from their repo
    root, where `my_rewards.score` names ./my_rewards.py)."""
    candidate = os.path.join(base_dir or os.getcwd(), *module_name.split(".")) + ".py"
    return candidate if os.path.isfile(candidate) else None


def _import_module(module_name: str, original: str, base_dir: str | None = None) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        is_the_plugin = module_name == missing or module_name.startswith(missing + ".")
        if not is_the_plugin:
            raise PluginError(
                f"plug-in path {original!r}: module {module_name!r} was found but imports {missing!r}, which is not "
                f"installed; install it where the job runs"
            ) from exc
        file_path = _module_file(module_name, base_dir)
        if file_path is not None:
            return _import_file(file_path, original, base_dir)
        raise PluginError(
            f"plug-in path {original!r}: module {module_name!r} not found ({exc}); "
            "check the spelling and that its package is on PYTHONPATH (or use 'file.py:function')"
        ) from exc
    except Exception as exc:
        raise PluginError(
            f"plug-in path {original!r}: importing module {module_name!r} failed: {exc!r}"
        ) from exc


def _positional_capacity(fn: Callable[..., Any], keywords: Sequence[str] = ()) -> tuple[int, float, list[str]]:
    """(required positional count, max positional count (inf with *args), positional names); parameters named in
    `keywords` are passed by name, so they are not counted as required positionally."""
    sig = inspect.signature(fn)
    required = 0
    maximum: float = 0
    names: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
            maximum += 1
            if p.default is inspect.Parameter.empty and not (
                    p.name in keywords and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD):
                required += 1
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            maximum = float("inf")
        elif (p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
              and p.name not in keywords):
            raise PluginError(f"has a required keyword-only parameter {p.name!r} that hpc_rl never passes")
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    by_name = {p.name for p in sig.parameters.values() if p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    unknown = [k for k in keywords if k not in by_name]
    if unknown and not takes_any:
        raise PluginError(f"is called with the keyword argument(s) {', '.join(unknown)}, which it does not take "
                          f"(name them as parameters or add **kwargs)")
    return required, maximum, names


def _defined_at(fn: Callable[..., Any]) -> str:
    """' (defined at file.py:LINE)' for a Python function or callable instance; '' when unknown."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__dict__.get("__call__", fn)
    try:
        return f" (defined at {inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]})"
    except (TypeError, OSError):
        return ""


def _is_async(fn: Callable[..., Any]) -> bool:
    # A callable instance is async when its __call__ is.
    call = None if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__dict__.get("__call__")
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


def load_callable(
    path: str,
    expected_params: Sequence[str] | None = None,
    *,
    check_names: bool = False,
    require_async: bool | None = None,
    base_dir: str | None = None,
    what: str = "plug-in",
    keywords: Sequence[str] = (),
) -> Callable[..., Any]:
    """Import the callable named by ``path`` and check it can be called as ``fn(*expected_params)``.

    path: ``"pkg.mod.fn"``, ``"pkg.mod:fn"`` or ``"file.py:fn"`` (relative files resolve against
        ``base_dir``, default the current directory).
    expected_params: the positional arguments hpc_rl will pass, e.g. ``["args", "sample"]``. The
        function must accept exactly that many positionally: at most that many required, and room
        for all of them (extra parameters with defaults, or ``*args``, are fine). ``None`` skips it.
    check_names: also require the leading positional parameter names to equal ``expected_params``.
    require_async: True -> must be ``async def``; False -> must not be; None -> either.
    what: the plug-in's role for error messages, e.g. ``"--custom-rm-path"``.
    keywords: the arguments hpc_rl will pass by name: each must be a parameter (or **kwargs must take it).

    Raises :class:`PluginError` naming the path and the problem.
    """
    target, attr = split_plugin_path(path)
    if target.endswith(".py") or os.sep in target or "/" in target:
        obj: Any = _import_file(target, path, base_dir)
    else:
        obj = _import_module(target, path, base_dir)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what} {path!r}: {target!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{what} {path!r}: {attr!r} is a {type(obj).__name__}, not a callable")

    if expected_params is not None:
        n = len(expected_params)
        try:
            required, maximum, names = _positional_capacity(obj, keywords)
        except PluginError as exc:
            raise PluginError(f"{what} {path!r}: {exc}") from None
        except (TypeError, ValueError):
            required, maximum, names = 0, float("inf"), []  # builtins without a signature: trust them
        wanted = f"({', '.join(expected_params)})"
        if required > n or maximum < n:
            raise PluginError(
                f"{what} {path!r}: hpc_rl calls it with {n} positional argument(s) {wanted}, but it takes "
                f"{required} required and at most {maximum if maximum != float('inf') else 'any'} positional "
                f"parameter(s) {tuple(names)}; change its signature to {attr}{wanted}{_defined_at(obj)}"
            )
        if check_names and names[:n] != list(expected_params):
            raise PluginError(
                f"{what} {path!r}: parameters are named {tuple(names[:n])}, expected {tuple(expected_params)}"
                f"{_defined_at(obj)}"
            )
    if require_async is not None and _is_async(obj) != require_async:
        kind = "an 'async def' function" if require_async else "a plain (non-async) function"
        raise PluginError(f"{what} {path!r}: must be {kind}{_defined_at(obj)}")
    return obj
