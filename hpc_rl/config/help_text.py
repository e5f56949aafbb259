"""`python -m hpc_rl.submit --help`: every config field with its slime flag, type, default and meaning.

Owns: generating that text from the schema (field docstrings are read from the schema's source with
`ast`, so the help cannot drift from the code) and from `slime_flags`' tables (Megatron model flags,
behaviour-stating flags, aliases, refused flags), and what hpc_rl does with each of slime's own flags
(`slime_flag_status`), listed in slime's groups. Nothing here changes a config.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from typing import Any

from hpc_rl.config.fsdp_flags import FSDP_FLAGS, FSDP_REFUSED
from hpc_rl.config import schema
from hpc_rl.config.settings_sources import flat_index, section_types
from hpc_rl.config.slime_flag_list import SLIME_LATER_FLAGS, GROUP_TITLES, slime_flag_list, slime_list_source
from hpc_rl.config.slime_flags import (
    ALIASES, COMPAT_FLAGS, EXPANDING_FLAGS, MODEL_FLAGS, REFUSED_FLAGS, REMOVED_BY_SLIME, UNBUILDABLE_MODEL_FLAGS,
)
from hpc_rl.config.typing_rules import type_name


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal written after it in the class body (first line)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "required"


def _flag_for(path: str) -> str:
    flat = {v: k for k, v in flat_index().items()}
    name = flat.get(path)
    return f"--{name.replace('_', '-')}" if name else f"--set {path}=V"


def field_rows() -> list[tuple[str, str, str, str, str]]:
    """(section.field, slime flag, type, default, meaning) for every field of every section."""
    rows = []
    top_docs = field_docs(schema.RunConfig)
    for f in dataclasses.fields(schema.RunConfig):
        if f.name in ("model", "run_dir"):
            rows.append((f.name, _flag_for(f.name), "str", _default(f), top_docs.get(f.name, "")))
    for section, section_type in section_types().items():
        docs = field_docs(section_type)
        hints = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            path = f"{section}.{f.name}"
            rows.append((path, _flag_for(path), type_name(hints[f.name]), _default(f), docs.get(f.name, "")))
    return rows


def _names(names: Any) -> str:
    return " ".join("--" + n.replace("_", "-") for n in sorted(names))


def slime_flag_status(name: str) -> str:
    """What hpc_rl does with slime's flag `name` (rollout_batch_size), in one line (with a note for the flags
    slime's later main removed)."""
    status = _flag_status(name)
    return f"{status} [{REMOVED_BY_SLIME[name]}]" if name in REMOVED_BY_SLIME else status


def _flag_status(name: str) -> str:
    refused = {**REFUSED_FLAGS, **UNBUILDABLE_MODEL_FLAGS}
    if name in refused:
        return f"refused: {refused[name]}"
    if name in COMPAT_FLAGS:
        compat = COMPAT_FLAGS[name]
        return f"accepted ({' | '.join(map(str, compat.accepted))}): {compat.behaviour}"
    if name in ALIASES:
        return f"-> {ALIASES[name]}"
    if name in FSDP_FLAGS:  # slime's FSDP backend (hpc_rl.config.fsdp_flags)
        flag = FSDP_FLAGS[name]
        values = "any value" if flag.accepted is None else " | ".join(map(str, flag.accepted))
        if name == "train_backend":
            values += " | megatron"
        return f"accepted ({values}): {flag.note}"
    if name in FSDP_REFUSED:
        return f"refused: {FSDP_REFUSED[name]}"
    if name in EXPANDING_FLAGS:
        return "sets " + ", ".join(f"{path} = {template.format('<value>')}" for path, template in EXPANDING_FLAGS[name])
    if name in MODEL_FLAGS:
        return "the model architecture (Megatron's model flags)"
    index = flat_index()
    if name in index:
        return f"-> {index[name]}"
    if name.startswith("no_") and name[3:] in index:
        return f"-> {index[name[3:]]} = false"
    return "not known to hpc_rl yet (an unknown setting)"


def slime_flag_lines() -> list[str]:
    """slime's own flags in slime's groups, each with what hpc_rl does with it."""
    by_group: dict[str, list[str]] = {}
    for flag in (*slime_flag_list(), *SLIME_LATER_FLAGS):
        by_group.setdefault(flag.group, []).append(f"  {flag.flag}: {slime_flag_status(flag.name)}")
    commit, date = slime_list_source()
    lines = [f"slime's own flags (slime/utils/arguments.py of THUDM/slime {commit[:10]}, {date}, and those its later "
             f"main added), by slime's groups:"]
    for group, title in GROUP_TITLES.items():
        if group in by_group:
            lines += [f" {title}:", *by_group.pop(group)]
    for group, rest in by_group.items():
        lines += [f" {group}:", *rest]
    return lines


def submit_help(usage: str) -> str:
    lines = [usage.rstrip(), "", "config fields (defaults < YAML files < flags):"]
    for path, flag, kind, default, meaning in field_rows():
        lines.append(f"  {flag:<44} {path} ({kind}, default {default})")
        if meaning:
            lines.append(f"      {meaning}")
    lines += ["", "Megatron model flags (slime's MODEL_ARGS; they define the architecture, checked against the",
              "HF config.json; --spec slime_plugins.models.glm4 get_glm_spec means GLM4):",
              "  " + _names(MODEL_FLAGS), "", "slime flags accepted because hpc_rl always does what they ask:"]
    lines += [f"  --{name.replace('_', '-')} {' | '.join(map(str, c.accepted))}: {c.behaviour}"
              for name, c in COMPAT_FLAGS.items()]
    lines += ["", "aliases:"] + [f"  --{a.replace('_', '-')} -> {path}" for a, path in ALIASES.items()]
    lines += ["", "refused (with what to do instead):"]
    lines += [f"  --{name.replace('_', '-')}: {reason}" for name, reason in {**REFUSED_FLAGS, **UNBUILDABLE_MODEL_FLAGS}.items()]
    lines += ["", *slime_flag_lines()]
    return "\n".join(lines)
