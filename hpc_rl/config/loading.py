"""Building a `RunConfig` from defaults < YAML file(s) < CLI, and the resolved-config file.

Owns: reading YAML with line numbers (so errors say file:line), the flat slime-style key index
(`rollout_batch_size` finds `rollout.rollout_batch_size`), slime's kebab-case CLI flags
(`--rollout-batch-size 32`, `--colocate`, `--eval-prompt-data aime /p`, `--sglang-X v`), Megatron's
model flags (`--num-layers 36 ...`, into `model_args`), `--set section.key=value`, slime's derived
values (`num_steps_per_rollout`, colocated `rollout_num_gpus`), and writing/reading
`<run_dir>/config.resolved.yaml`. Every problem is reported in one pass (`ConfigErrors`). What
slime's other flags do here is `hpc_rl.config.slime_flags`; cross-field validation is
`hpc_rl.config.validation`'s job.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import yaml

from hpc_rl.config.eval_config_file import eval_datasets_from_file
from hpc_rl.config.megatron_model import architecture_from_flags
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.problems import Problem, SectionProblems, locate, remember_locations
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sections.rollout import EvalDataset
from hpc_rl.config.settings_sources import (
    MEGATRON_PREFIX, MODEL_ARGS_FIELD, TOP_LEVEL_FIELDS, Setting, cli_settings_and_problems, parse_cli_settings,
    read_yaml_settings, section_types, yaml_settings_and_problems,
)
from hpc_rl.config.settings_sources import _field_hint as field_hint
from hpc_rl.config.slime_flags import (
    APPENDED_FIELDS, PLUGIN_PATH_FIELDS, SLIME_PLUGIN_PATHS, SLIME_RM_MODULES, as_slime_module_path,
)
from hpc_rl.config.training_modes import derive_mode_settings
from hpc_rl.config.typing_rules import ConfigError, ConfigErrors, coerce_value

RESOLVED_CONFIG_NAME = "config.resolved.yaml"
log = logging.getLogger(__name__)

__all__ = ["ConfigError", "ConfigErrors", "Setting", "build_config", "load_config", "load_resolved_config",
           "parse_cli_settings", "read_yaml_settings", "write_resolved_config"]


def _messages(error: ConfigError) -> list[str | Problem]:
    """The problems an error carries (located `Problem`s where it has them, else its text)."""
    if isinstance(error, ConfigErrors):
        return error.items
    return [error.problem if error.problem is not None else str(error)]


def _located(error: ConfigError, setting: Setting) -> ConfigError:
    """`error` of a value of `setting`, its problem located at the setting's file:line or flag."""
    problem = error.problem
    prefix = f"{setting.where}: "
    if problem is None or not problem.field.startswith(prefix):
        return error
    return ConfigError(str(error), dataclasses.replace(problem, field=problem.field[len(prefix):],
                                                       location=setting.where))


LEGACY_EVAL_NAME = "aime"
"""slime's name for a lone --eval-prompt-data path (its "[legacy] only one eval_prompt_data" rule)."""


def _eval_datasets(value: Any, where: str) -> list[EvalDataset]:
    """name/path pairs from a flat list [n, p, ...], a mapping {n: p}, or [{name, path}, ...]; one path
    alone is named `aime`, as slime names it."""
    if isinstance(value, str) or isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        path = value if isinstance(value, str) else value[0]
        log.info("--eval-prompt-data %s: one path without a name; named %r as slime does ([legacy] rule)",
                 path, LEGACY_EVAL_NAME)
        return [EvalDataset(name=LEGACY_EVAL_NAME, path=path)]
    if isinstance(value, dict):
        return [EvalDataset(name=str(k), path=str(v)) for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return [coerce_value(v, EvalDataset, where) for v in value]
    if isinstance(value, list):
        if len(value) % 2:
            raise ConfigError(f"{where}: eval_prompt_data takes name/path pairs, got an odd count ({len(value)})")
        return [EvalDataset(name=str(value[k]), path=str(value[k + 1])) for k in range(0, len(value), 2)]
    raise ConfigError(f"{where}: eval_prompt_data takes name/path pairs")


def _slime_plugin_path(path: str, value: Any, raw: dict[str, dict[str, Any]], where: str) -> Any:
    """slime's (and vime's) plug-in import paths -> hpc_rl's equivalents, with one log line each."""
    slime_value = as_slime_module_path(value) if isinstance(value, str) else None
    if slime_value is None:
        return value
    flag = "--" + path.split(".")[1].replace("_", "-")
    module = slime_value.rpartition(".")[0]
    for known in (value, slime_value):
        if known in SLIME_PLUGIN_PATHS:
            target = SLIME_PLUGIN_PATHS[known]
            log.info("%s %s is slime's; hpc_rl uses %s", flag, value, target or "its built-in default")
            return target
    if path == "rollout.custom_rm_path" and module in SLIME_RM_MODULES:
        rm_type = SLIME_RM_MODULES[module]
        log.info("%s %s is slime's %s reward; hpc_rl uses rm_type %s", flag, value, rm_type, rm_type)
        raw["rollout"]["rm_type"] = rm_type
        return None
    raise ConfigError(f"{where}: {flag} {value}: a slime module hpc_rl has no equivalent for; "
                      f"port the function into your own module and give its path")


def _apply_setting(setting: Setting, raw: dict[str, dict[str, Any]], top: dict[str, Any]) -> None:
    if setting.path in TOP_LEVEL_FIELDS:
        top[setting.path] = coerce_value(setting.value, str, f"{setting.where}: {setting.path}")
        return
    if setting.path == MODEL_ARGS_FIELD:
        top[MODEL_ARGS_FIELD] = coerce_value(setting.value, ModelArchitecture | None, f"{setting.where}: model_args")
        return
    if setting.path.startswith(MEGATRON_PREFIX):
        raw.setdefault("megatron", {})[setting.path[len(MEGATRON_PREFIX):]] = setting.value
        return
    parts = setting.path.split(".", 2)
    if parts[:2] == ["sglang", "extra_args"] and len(parts) == 3:  # one SGLang option: sglang.extra_args.<name>
        raw["sglang"].setdefault("extra_args", {})[parts[2]] = setting.value
        return
    section, name = parts
    where = f"{setting.where}: {setting.path}"
    if setting.path == "eval.eval_prompt_data":
        raw[section][name] = _eval_datasets(setting.value, where)
    elif setting.path == "sglang.extra_args":
        if not isinstance(setting.value, dict):
            raise ConfigError(f"{where}: expected a mapping of SGLang server options, got {setting.value!r}; write "
                              "--set 'sglang.extra_args={chunked_prefill_size: 4096}' or one option as "
                              "--set sglang.extra_args.chunked_prefill_size=4096")
        raw[section].setdefault(name, {}).update(coerce_value(setting.value, dict[str, Any], where))
    elif setting.path in APPENDED_FIELDS:  # slime's action="append": every occurrence adds
        raw[section][name] = [*raw[section].get(name, []), *coerce_value(setting.value, field_hint(setting.path), where)]
    else:
        value = coerce_value(setting.value, field_hint(setting.path), where)
        raw[section][name] = _slime_plugin_path(setting.path, value, raw, where) if setting.path in PLUGIN_PATH_FIELDS \
            else value


def _given_or_default(raw: dict[str, dict[str, Any]], section: str, name: str) -> Any:
    if name in raw[section]:
        return raw[section][name]
    return next(f.default for f in dataclasses.fields(section_types()[section]) if f.name == name)


def _derive_slime_values(raw: dict[str, dict[str, Any]]) -> None:
    """What slime derives when a value is not given: the batch split, colocated GPUs, offload."""
    training, cluster = raw["training"], raw["cluster"]
    samples = _given_or_default(raw, "rollout", "rollout_batch_size") * _given_or_default(
        raw, "rollout", "n_samples_per_prompt")
    steps, batch = training.get("num_steps_per_rollout"), training.get("global_batch_size")
    if batch is None and steps is None:
        training["global_batch_size"], training["num_steps_per_rollout"] = samples, 1
    elif batch is None and steps:
        training["global_batch_size"] = samples // steps
    elif steps is None and batch and samples % batch == 0 and samples >= batch:
        training["num_steps_per_rollout"] = samples // batch
    colocate = bool(_given_or_default(raw, "cluster", "colocate"))
    if colocate and cluster.get("rollout_num_gpus") is None:
        cluster["rollout_num_gpus"] = (_given_or_default(raw, "cluster", "actor_num_nodes")
                                       * _given_or_default(raw, "cluster", "actor_num_gpus_per_node"))
    if training.get("offload_train") is None:
        training["offload_train"] = colocate


def _hf_config(raw: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    checkpoint = raw["checkpoint"].get("hf_checkpoint")
    path = Path(checkpoint) / "config.json" if checkpoint else None
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None  # validation reports an unreadable config.json


def _model_args(raw: dict[str, dict[str, Any]], top: dict[str, Any],
                problems: list[str | Problem]) -> ModelArchitecture | None:
    flags = raw.pop("megatron", {})
    if not flags:
        return top.get(MODEL_ARGS_FIELD)
    base = dataclasses.asdict(top[MODEL_ARGS_FIELD]) if top.get(MODEL_ARGS_FIELD) else None
    if base is None and top.get("model") and Path(top["model"]).is_file():
        try:
            base = ModelArchitecture.from_yaml(top["model"]).to_dict()
        except ValueError as error:
            problems.append(str(error))
            return None
    arch, arch_problems = architecture_from_flags(flags, base=base, hf_config=_hf_config(raw))
    problems += [f"model flags: {p}" for p in arch_problems]
    return arch


def build_config(settings: list[Setting]) -> RunConfig:
    """Defaults, then `settings` in order (later wins); each section is constructed once from the
    explicit values, so derived defaults (over_sampling_batch_size, eps_clip_high, slime's batch split)
    follow them. Raises ConfigErrors listing every problem."""
    raw: dict[str, dict[str, Any]] = {name: {} for name in section_types()}
    top: dict[str, Any] = {}
    wheres: dict[str, str] = {}
    problems: list[str | Problem] = []
    for setting in settings:
        wheres[setting.path] = setting.where
        try:
            _apply_setting(setting, raw, top)
        except ConfigError as error:
            problems += _messages(_located(error, setting))
    top[MODEL_ARGS_FIELD] = _model_args(raw, top, problems)
    problems += derive_mode_settings(raw, lambda section, name: _given_or_default(raw, section, name))
    if raw["eval"].get("eval_config"):  # slime's --eval-config replaces --eval-prompt-data; the resolved config
        try:                            # keeps the datasets it read (every process reads them, not the file)
            raw["eval"]["eval_prompt_data"] = eval_datasets_from_file(raw["eval"].pop("eval_config"),
                                                                      wheres.get("eval.eval_config", "config"))
        except ConfigError as error:
            problems += _messages(error)
    _derive_slime_values(raw)
    sections: dict[str, Any] = {}
    for name, section_type in section_types().items():
        try:
            sections[name] = section_type(**raw[name])
        except SectionProblems as error:  # each at the line (or flag) that set its field
            problems += locate(error.problems, wheres)
        except (ValueError, TypeError) as error:
            origin = next((w for p, w in wheres.items() if p.startswith(name + ".")), "defaults")
            problems.append(f"{error} (set at {origin})")
    if problems:
        raise ConfigErrors(problems)
    config = RunConfig(**top, **sections)
    remember_locations(config, wheres)  # validation's problems point at the same lines
    return config


def load_config(config_files: list[str | Path], cli_args: list[str] | None = None) -> RunConfig:
    """defaults < each YAML file in order < CLI flags. Raises ConfigErrors with every file:line or flag."""
    settings: list[Setting] = []
    problems: list[str | Problem] = []
    for path in config_files:
        try:
            file_settings, file_problems = yaml_settings_and_problems(path)
        except ConfigError as error:
            problems += _messages(error)
            continue
        settings += file_settings
        problems += file_problems
    try:
        cli_settings, cli_problems = cli_settings_and_problems(cli_args or [])
        settings += cli_settings
        problems += cli_problems
    except ConfigError as error:
        problems += _messages(error)
    try:
        config = build_config(settings)
    except ConfigError as error:
        problems += _messages(error)
    if problems:
        raise ConfigErrors(problems)
    return config


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


MODEL_FILE_NAME = "model.yaml"


def write_model_file(config: RunConfig, run_dir: str | Path) -> None:
    """An architecture given by Megatron's model flags becomes `<run_dir>/model.yaml` and `config.model`
    points at it: every process (trainer, weight sync, converters) reads one architecture file."""
    if config.model_args is None:
        return
    path = Path(run_dir) / MODEL_FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_args.to_dict(), sort_keys=False))
    config.model = str(path)


def write_resolved_config(config: RunConfig, run_dir: str | Path) -> Path:
    """Write `<run_dir>/config.resolved.yaml` (every field, explicit); every process reads it.
    With model flags, `<run_dir>/model.yaml` too (and `config.model` is set to it)."""
    write_model_file(config, run_dir)
    path = Path(run_dir) / RESOLVED_CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)
    tmp = path.with_suffix(".tmp")
    write_private_if_secret(tmp, text, secret=holds_secret(config))
    tmp.replace(path)
    return path


def holds_secret(config: RunConfig) -> bool:
    """Whether the resolved config carries a credential (`logging.wandb_key`): then only its owner may read it,
    as the run's secret (0600)."""
    return bool(config.logging.wandb_key)


def write_private_if_secret(path: str | Path, text: str, *, secret: bool) -> None:
    """Write `path` (replaced if there): mode 0600 when `secret`, else 0644 (both whatever the umask says, and
    from the first byte: the file is never readable by others with the key in it, not even for an instant)."""
    mode = 0o600 if secret else 0o644
    Path(path).unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), mode)
        handle.write(text)


def load_resolved_config(path: str | Path) -> RunConfig:
    """Read a resolved config (a run dir or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESOLVED_CONFIG_NAME
    return load_config([path])
