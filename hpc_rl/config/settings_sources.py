"""Reading settings from YAML files and from slime-style command lines, each with where it came from.

Owns: the flat slime-style key index (`rollout_batch_size` finds `rollout.rollout_batch_size`, built
on first use, never at import), resolving a key to its field path, YAML with line numbers, argv
tokenising (`--flag v1 v2`, `--flag=v`, `--no-flag`, `--set a.b=v`), and routing slime's other
flags through `hpc_rl.config.slime_flags` (and vime's `--vllm-*` through `hpc_rl.config.vllm_flags`) (Megatron model flags -> `megatron.<flag>` settings,
behaviour-stating flags accepted, aliases renamed, the rest refused with their reason). Every
problem of a source is collected (`ConfigErrors`), not just the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from hpc_rl.config.fsdp_flags import FSDP_FLAGS, FSDP_REFUSED, FsdpFlagError, fsdp_flag_settings
from hpc_rl.config.moe_layer_freq import LayerFreqError, parse_layer_freq
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sections.rollout import SGLangConfig
from hpc_rl.config.slime_flags import (
    ANY_VALUE, ALIASES, COMPAT_FLAGS, EXPANDING_FLAGS, MODEL_FLAGS, MODEL_SWITCHES, MODEL_VALUE_FLAGS, REFUSED_FLAGS,
    UNBUILDABLE_MODEL_FLAGS,
)
from hpc_rl.config.typing_rules import ConfigError, ConfigErrors, coerce_value, parse_cli_scalar
from hpc_rl.config.vllm_flags import VLLM_PREFIX, vllm_settings

TOP_LEVEL_FIELDS = ("model", "run_dir")
MODEL_ARGS_FIELD = "model_args"
MEGATRON_PREFIX = "megatron."


@dataclasses.dataclass
class Setting:
    """One value from one source, with where it came from (for error messages)."""

    path: str
    value: Any
    where: str


@functools.cache
def section_types() -> Mapping[str, type]:
    """Section name -> its dataclass, for every section of RunConfig."""
    hints = typing.get_type_hints(RunConfig)
    skip = (*TOP_LEVEL_FIELDS, MODEL_ARGS_FIELD)
    return MappingProxyType({f.name: hints[f.name] for f in dataclasses.fields(RunConfig) if f.name not in skip})


@functools.cache
def flat_index() -> Mapping[str, str]:
    """flat field name -> 'section.field'; names present in two sections must be qualified.
    slime spells the SGLang section's own fields with a `sglang_` prefix."""
    index: dict[str, str] = {}
    seen_twice: set[str] = set()
    for section, section_type in section_types().items():
        for f in dataclasses.fields(section_type):
            if f.name in index:
                seen_twice.add(f.name)
            index[f.name] = f"{section}.{f.name}"
    for name in seen_twice:
        del index[name]
    for name in TOP_LEVEL_FIELDS:
        index[name] = name
    for f in dataclasses.fields(SGLangConfig):
        if f.name != "extra_args":
            index[f"sglang_{f.name}"] = f"sglang.{f.name}"
    return MappingProxyType(index)


def resolve_key(key: str, where: str) -> str:
    """The field path `key` names (flat slime name, or section.field); ConfigError if none."""
    if "." in key:
        section, name = key.split(".", 1)
        if section == "sglang" and name.startswith("extra_args.") and len(name) > len("extra_args."):
            return key  # one SGLang server option (--set sglang.extra_args.chunked_prefill_size=4096)
        if section not in section_types():
            raise ConfigError(f"{where}: unknown section {section!r}; sections: {', '.join(section_types())}")
        names = {f.name for f in dataclasses.fields(section_types()[section])}
        if name not in names:
            hint = difflib.get_close_matches(name, names, n=1)
            raise ConfigError(
                f"{where}: {section} has no field {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
            )
        return key
    index = flat_index()
    if key in index:
        return index[key]
    if key.startswith("sglang_"):
        return f"sglang.extra_args.{key[len('sglang_'):]}"
    hint = difflib.get_close_matches(key, [*index, *MODEL_FLAGS, *ALIASES], n=1)
    raise ConfigError(f"{where}: unknown setting {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _megatron_value(name: str, value: Any, where: str) -> Any:
    if name in MODEL_SWITCHES:
        return coerce_value(value, bool, where)
    kind = MODEL_VALUE_FLAGS[name]
    if name in ("moe_layer_freq", "window_attn_skip_freq", "linear_attention_freq"):  # Megatron's moe_freq_type: an int N or a list expression ([1]*3+[0])*12
        try:
            return parse_layer_freq(value)
        except LayerFreqError as error:
            raise ConfigError(f"{where}: {_flag(name)} {error}") from error
    if kind is list:
        values = value if isinstance(value, list) else [value]
        return [str(v) for v in values]
    return coerce_value(value, kind, where)


def _accepts(accepted: tuple[Any, ...], value: Any) -> bool:
    """`value` is one of `accepted` (True is not 1 here; ANY_VALUE takes every value)."""
    return ANY_VALUE in accepted or any(isinstance(a, bool) == isinstance(value, bool) and a == value for a in accepted)


def slime_flag_settings(name: str, value: Any, where: str) -> list[Setting] | None:
    """Settings for one of slime's flags that is not an hpc_rl field name (None: not one of them).
    Raises ConfigError for a refused flag or a value hpc_rl does not do."""
    if name in REFUSED_FLAGS:
        raise ConfigError(f"{where}: {_flag(name)} is refused: {REFUSED_FLAGS[name]}")
    if name in UNBUILDABLE_MODEL_FLAGS:
        raise ConfigError(f"{where}: {_flag(name)} is refused: {UNBUILDABLE_MODEL_FLAGS[name]}")
    if name in EXPANDING_FLAGS:
        return [Setting(path, template.format(value), where) for path, template in EXPANDING_FLAGS[name]]
    if name.startswith(VLLM_PREFIX) or name.startswith("no_" + VLLM_PREFIX):
        name = VLLM_PREFIX + "no_" + name[len("no_" + VLLM_PREFIX):] if name.startswith("no_") else name
        return [Setting(path, setting, where) for path, setting in vllm_settings(name, value, where).items()]
    if name in FSDP_FLAGS or name in FSDP_REFUSED:  # slime's FSDP backend's line: the Megatron trainer's settings
        try:
            return [Setting(path, setting, where) for path, setting in fsdp_flag_settings(name, value).items()]
        except FsdpFlagError as error:
            raise ConfigError(f"{where}: {error}") from None
    if name in COMPAT_FLAGS:
        compat = COMPAT_FLAGS[name]
        if _accepts(compat.accepted, value):
            return []
        accepted = " or ".join(repr(v) for v in compat.accepted)
        raise ConfigError(f"{where}: {_flag(name)} {value!r} is refused: {compat.behaviour} (accepted: {accepted})")
    if name in MODEL_FLAGS:
        return [Setting(MEGATRON_PREFIX + name, _megatron_value(name, value, where), where)]
    if name in ALIASES:
        return [Setting(ALIASES[name], value, where)]
    return None


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser where PyYAML has it (the same nodes and line marks, several times faster)."""


def _construct(node: yaml.Node) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _yaml_section(path: Path, key: str, value_node: yaml.MappingNode, problems: list[str]) -> list[Setting]:
    settings = []
    for sub_key_node, sub_value_node in value_node.value:
        sub_where = f"{path}:{sub_key_node.start_mark.line + 1}"
        if key == "sglang" and sub_key_node.value == "extra_args":
            for extra_key, extra_value in (_construct(sub_value_node) or {}).items():
                settings.append(Setting(f"sglang.extra_args.{extra_key}", extra_value, sub_where))
            continue
        try:
            full = resolve_key(f"{key}.{sub_key_node.value}", sub_where)
        except ConfigError as error:
            problems.append(str(error))
            continue
        settings.append(Setting(full, _construct(sub_value_node), sub_where))
    return settings


def read_yaml_settings(path: str | Path) -> list[Setting]:
    """Settings of one YAML config file, each with its file:line; ConfigErrors lists every bad key."""
    settings, problems = yaml_settings_and_problems(path)
    if problems:
        raise ConfigErrors(problems)
    return settings


def yaml_settings_and_problems(path: str | Path) -> tuple[list[Setting], list[str]]:
    """The good settings of one YAML file and a message per bad key (so later checks still run)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        root = yaml.compose(path.read_text(), Loader=_YAML_LOADER)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if root is None:
        return [], []
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}:{root.start_mark.line + 1}: the top level must be a mapping of settings")
    settings: list[Setting] = []
    problems: list[str] = []
    for key_node, value_node in root.value:
        key = key_node.value
        where = f"{path}:{key_node.start_mark.line + 1}"
        if key in section_types() and isinstance(value_node, yaml.MappingNode):
            settings += _yaml_section(path, key, value_node, problems)
            continue
        try:
            if key == MODEL_ARGS_FIELD:
                settings.append(Setting(MODEL_ARGS_FIELD, _construct(value_node), where))
                continue
            special = slime_flag_settings(key, _construct(value_node), where)
            settings += special if special is not None else [Setting(resolve_key(key, where), _construct(value_node), where)]
        except ConfigError as error:
            problems.append(str(error))
    return settings, problems


def _tokens(argv: list[str]) -> list[tuple[str, list[str]]]:
    """argv as (flag token, its values) pairs; a value is every following token not starting with --."""
    pairs: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"command line: unexpected argument {token!r} (flags start with --)")
        if "=" in token and not token.startswith("--set"):
            flag, inline = token.split("=", 1)
            pairs.append((flag, [inline]))
            i += 1
            continue
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        pairs.append((token, argv[i + 1:j]))
        i = j
    return pairs


@functools.cache
def _section_hints(section: str) -> Mapping[str, Any]:
    """A section's field types, resolved once (typing.get_type_hints compiles every annotation string each call)."""
    return MappingProxyType(typing.get_type_hints(section_types()[section]))


def _field_hint(path: str) -> Any:
    if path in TOP_LEVEL_FIELDS:
        return str
    section, name = path.split(".", 1)
    return _section_hints(section)[name]


def _is_list_field(path: str) -> bool:
    hint = _field_hint(path)
    return any(typing.get_origin(candidate) is list for candidate in (hint, *typing.get_args(hint)))


def _cli_value(values: list[str]) -> Any:
    if not values:
        return True
    parsed = [parse_cli_scalar(v) for v in values]
    return parsed[0] if len(parsed) == 1 else parsed


def _field_setting(token: str, path: str, values: list[str], negated: bool) -> Setting:
    where = f"command line {token}"
    if path.startswith("sglang.extra_args."):
        return Setting(path, _cli_value(values), where)
    if _field_hint(path) is bool:
        if negated and values:
            raise ConfigError(f"{where}: takes no value")
        if len(values) > 1:
            raise ConfigError(f"{where}: takes at most one value (true/false)")
        return Setting(path, False if negated else (values[0] if values else True), where)
    if path == "eval.eval_prompt_data":
        return Setting(path, values, where)
    if _is_list_field(path):
        return Setting(path, [parse_cli_scalar(v) for v in values], where)
    if len(values) != 1:
        raise ConfigError(f"{where}: takes exactly one value, got {len(values)}")
    return Setting(path, parse_cli_scalar(values[0]), where)


def _one_flag(token: str, values: list[str]) -> list[Setting]:
    if token == "--set":
        if len(values) != 1 or "=" not in values[0]:
            raise ConfigError("command line: --set takes section.key=value")
        key, raw = values[0].split("=", 1)
        return [Setting(resolve_key(key.replace("-", "_"), f"--set {key}"), parse_cli_scalar(raw), f"--set {key}")]
    name = token[2:].replace("-", "_")
    where = f"command line {token}"
    value: Any = values if name == "spec" else " ".join(values) if name == "moe_layer_freq" else _cli_value(values)
    special = slime_flag_settings(name, value, where)
    if special is not None:
        return special
    negated = name.startswith("no_") and name[3:] in (*flat_index(), *ALIASES)
    if negated and name[3:] in ALIASES:
        return [Setting(ALIASES[name[3:]], False, where)]
    return [_field_setting(token, resolve_key(name[3:] if negated else name, token), values, negated)]


def parse_cli_settings(argv: list[str]) -> list[Setting]:
    """slime-style flags and `--set a.b=v` into settings (in order: later wins); ConfigErrors lists every bad flag."""
    settings, problems = cli_settings_and_problems(argv)
    if problems:
        raise ConfigErrors(problems)
    return settings


def cli_settings_and_problems(argv: list[str]) -> tuple[list[Setting], list[str]]:
    """The good settings of a command line and a message per bad flag."""
    settings: list[Setting] = []
    problems: list[str] = []
    for token, values in _tokens(argv):
        try:
            settings += _one_flag(token, values)
        except ConfigError as error:
            problems.append(str(error))
    return settings, problems

