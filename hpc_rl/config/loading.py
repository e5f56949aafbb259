"""Building a `RunConfig` from defaults < YAML file(s) < CLI, and the resolved-config file.

Owns: reading YAML with line numbers (so errors say file:line), the flat slime-style key index
(`rollout_batch_size` finds `rollout.rollout_batch_size`), slime's kebab-case CLI flags
(`--rollout-batch-size 32`, `--colocate`, `--eval-prompt-data aime /p`, `--sglang-X v`),
`--set section.key=value`, and writing/reading `<run_dir>/config.resolved.yaml`.
Cross-field validation is `hpc_rl.config.validation`'s job.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.schema import EvalDataset, RunConfig, SGLangConfig
from hpc_rl.config.typing_rules import ConfigError, coerce_value, parse_cli_scalar

TOP_LEVEL_FIELDS = ("model", "run_dir")
RESOLVED_CONFIG_NAME = "config.resolved.yaml"


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig) if f.name not in TOP_LEVEL_FIELDS}


SECTION_TYPES = _section_types()


def _build_flat_index() -> dict[str, str]:
    """flat field name -> 'section.field'; names present in two sections must be qualified."""
    index: dict[str, str] = {}
    seen_twice: set[str] = set()
    for section, section_type in SECTION_TYPES.items():
        for f in dataclasses.fields(section_type):
            if f.name in index:
                seen_twice.add(f.name)
            index[f.name] = f"{section}.{f.name}"
    for name in seen_twice:
        del index[name]
    for name in TOP_LEVEL_FIELDS:
        index[name] = name
    return index


FLAT_INDEX = _build_flat_index()
# slime spells the SGLang section's own fields with a `sglang_` prefix.
for _f in dataclasses.fields(SGLangConfig):
    if _f.name != "extra_args":
        FLAT_INDEX[f"sglang_{_f.name}"] = f"sglang.{_f.name}"


@dataclasses.dataclass
class Setting:
    """One value from one source, with where it came from (for error messages)."""

    path: str
    value: Any
    where: str


def _resolve_key(key: str, where: str) -> str:
    if "." in key:
        section, name = key.split(".", 1)
        if section not in SECTION_TYPES:
            raise ConfigError(f"{where}: unknown section {section!r}; sections: {', '.join(SECTION_TYPES)}")
        names = {f.name for f in dataclasses.fields(SECTION_TYPES[section])}
        if name not in names:
            hint = difflib.get_close_matches(name, names, n=1)
            raise ConfigError(
                f"{where}: {section} has no field {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
            )
        return key
    if key in FLAT_INDEX:
        return FLAT_INDEX[key]
    if key.startswith("sglang_"):
        return f"sglang.extra_args.{key[len('sglang_'):]}"
    if key in {f.name for f in dataclasses.fields(ModelArchitecture)}:
        raise ConfigError(f"{where}: {key!r} is a model-architecture field: set it in the model file (`model:`)")
    hint = difflib.get_close_matches(key, list(FLAT_INDEX), n=1)
    raise ConfigError(f"{where}: unknown setting {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""))


def _construct(node: yaml.Node) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def read_yaml_settings(path: str | Path) -> list[Setting]:
    """Settings of one YAML config file, each with its file:line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        root = yaml.compose(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if root is None:
        return []
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}:{root.start_mark.line + 1}: the top level must be a mapping of settings")
    settings: list[Setting] = []
    for key_node, value_node in root.value:
        key = key_node.value
        where = f"{path}:{key_node.start_mark.line + 1}"
        if key in SECTION_TYPES and isinstance(value_node, yaml.MappingNode):
            for sub_key_node, sub_value_node in value_node.value:
                sub_where = f"{path}:{sub_key_node.start_mark.line + 1}"
                if key == "sglang" and sub_key_node.value == "extra_args":
                    for extra_key, extra_value in (_construct(sub_value_node) or {}).items():
                        settings.append(Setting(f"sglang.extra_args.{extra_key}", extra_value, sub_where))
                    continue
                full = _resolve_key(f"{key}.{sub_key_node.value}", sub_where)
                settings.append(Setting(full, _construct(sub_value_node), sub_where))
        else:
            settings.append(Setting(_resolve_key(key, where), _construct(value_node), where))
    return settings


def _field_hint(path: str) -> Any:
    if path in TOP_LEVEL_FIELDS:
        return str
    section, name = path.split(".", 1)
    return typing.get_type_hints(SECTION_TYPES[section])[name]


def _is_bool_flag(path: str) -> bool:
    if path.startswith("sglang.extra_args."):
        return False
    hint = _field_hint(path)
    return hint is bool


def _is_list_field(path: str) -> bool:
    if path.startswith("sglang.extra_args."):
        return False
    hint = _field_hint(path)
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) is list:
            return True
    return False


def parse_cli_settings(argv: list[str]) -> list[Setting]:
    """slime-style flags and `--set a.b=v` into settings (in order: later wins)."""
    settings: list[Setting] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"command line: unexpected argument {token!r} (flags start with --)")
        if token == "--set":
            if i + 1 >= len(argv) or "=" not in argv[i + 1]:
                raise ConfigError("command line: --set takes section.key=value")
            key, raw = argv[i + 1].split("=", 1)
            path = _resolve_key(key.replace("-", "_"), f"--set {key}")
            settings.append(Setting(path, parse_cli_scalar(raw), f"--set {key}"))
            i += 2
            continue
        flag = token[2:]
        if "=" in flag:
            flag, inline = flag.split("=", 1)
            values: list[str] = [inline]
        else:
            values = []
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                values.append(argv[j])
                j += 1
        i += 1 + (0 if "=" in token else len(values))
        name = flag.replace("-", "_")
        negated = name.startswith("no_") and name[3:] in FLAT_INDEX
        path = _resolve_key(name[3:] if negated else name, token)
        where = f"command line {token}"
        if _is_bool_flag(path):
            if negated:
                value: Any = False
                if values:
                    raise ConfigError(f"{where}: takes no value")
            elif not values:
                value = True
            elif len(values) == 1:
                value = values[0]
            else:
                raise ConfigError(f"{where}: takes at most one value (true/false)")
        elif path == "eval.eval_prompt_data":
            value = values
        elif _is_list_field(path):
            value = [parse_cli_scalar(v) for v in values]
        elif len(values) == 1:
            value = parse_cli_scalar(values[0])
        elif not values and path.startswith("sglang.extra_args."):
            value = True
        else:
            raise ConfigError(f"{where}: takes exactly one value, got {len(values)}")
        settings.append(Setting(path, value, where))
    return settings


def _eval_datasets(value: Any, where: str) -> list[EvalDataset]:
    """name/path pairs from a flat list [n, p, ...], a mapping {n: p}, or [{name, path}, ...]."""
    if isinstance(value, dict):
        return [EvalDataset(name=str(k), path=str(v)) for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return [coerce_value(v, EvalDataset, where) for v in value]
    if isinstance(value, list):
        if len(value) % 2:
            raise ConfigError(f"{where}: eval_prompt_data takes name/path pairs, got an odd count ({len(value)})")
        return [EvalDataset(name=str(value[k]), path=str(value[k + 1])) for k in range(0, len(value), 2)]
    raise ConfigError(f"{where}: eval_prompt_data takes name/path pairs")


def build_config(settings: list[Setting]) -> RunConfig:
    """Defaults, then `settings` in order (later wins); each section is constructed once from the
    explicit values, so derived defaults (over_sampling_batch_size, eps_clip_high) follow them."""
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTION_TYPES}
    top: dict[str, Any] = {}
    wheres: dict[str, str] = {}
    for setting in settings:
        wheres[setting.path] = setting.where
        if setting.path in TOP_LEVEL_FIELDS:
            top[setting.path] = coerce_value(setting.value, str, setting.where)
            continue
        parts = setting.path.split(".")
        if parts[:2] == ["sglang", "extra_args"]:
            raw["sglang"].setdefault("extra_args", {})[parts[2]] = setting.value
            continue
        section, name = parts
        if setting.path == "eval.eval_prompt_data":
            raw[section][name] = _eval_datasets(setting.value, setting.where)
        elif setting.path == "sglang.extra_args":
            raw[section].setdefault(name, {}).update(coerce_value(setting.value, dict[str, Any], setting.where))
        else:
            raw[section][name] = coerce_value(setting.value, _field_hint(setting.path), setting.where)
    sections: dict[str, Any] = {}
    for name, section_type in SECTION_TYPES.items():
        try:
            sections[name] = section_type(**raw[name])
        except (ValueError, TypeError) as error:
            origin = next((w for p, w in wheres.items() if p.startswith(name + ".")), "defaults")
            raise ConfigError(f"{error} (set at {origin})") from error
    return RunConfig(**top, **sections)


def load_config(config_files: list[str | Path], cli_args: list[str] | None = None) -> RunConfig:
    """defaults < each YAML file in order < CLI flags. Raises ConfigError with file:line or flag."""
    settings: list[Setting] = []
    for path in config_files:
        settings.extend(read_yaml_settings(path))
    settings.extend(parse_cli_settings(cli_args or []))
    return build_config(settings)


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def write_resolved_config(config: RunConfig, run_dir: str | Path) -> Path:
    """Write `<run_dir>/config.resolved.yaml` (every field, explicit); every process reads it."""
    path = Path(run_dir) / RESOLVED_CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def load_resolved_config(path: str | Path) -> RunConfig:
    """Read a resolved config (a run dir or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESOLVED_CONFIG_NAME
    return load_config([path])
