"""slime's --eval-config file: eval datasets with their own sampling and data keys.

Owns: reading the file (YAML or JSON; `eval: {defaults, datasets}` or that mapping at the top level, as slime's
OmegaConf loader accepts; OmegaConf's `${...}` interpolation is not evaluated), applying `defaults` under each
dataset's own values, and refusing what hpc_rl's eval does not do per dataset (a custom reward, another chat
template, a remote app service, ...), naming the file, the dataset and the key. The result is the eval section's
`eval_prompt_data`, read at config load time, so every process gets the datasets in config.resolved.yaml.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from hpc_rl.config.sections.rollout import EvalDataset
from hpc_rl.config.typing_rules import ConfigError, coerce_value

PER_DATASET_FIELDS = tuple(f.name for f in dataclasses.fields(EvalDataset) if f.name not in ("name", "path"))
"""The settings a dataset of the file may give (EvalDataset's own fields)."""


def eval_datasets_from_file(path: str | Path, where: str) -> list[EvalDataset]:
    """The datasets of an --eval-config file (ConfigError naming the file and what is wrong)."""
    source = f"{where}: eval_config {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"{source}: cannot be read ({error}); give an existing YAML file") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from error
    section = data.get("eval", data) if isinstance(data, dict) else None
    if not isinstance(section, dict) or not isinstance(section.get("datasets"), list) or not section["datasets"]:
        raise ConfigError(f"{source}: needs a list of datasets under eval.datasets (each with name and path)")
    defaults = section.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{source}: eval.defaults must be a mapping")
    return [_dataset(index, entry, defaults, source) for index, entry in enumerate(section["datasets"])]


def _dataset(index: int, entry: Any, defaults: dict[str, Any], source: str) -> EvalDataset:
    if not isinstance(entry, dict) or "name" not in entry or "path" not in entry:
        raise ConfigError(f"{source}: dataset {index} must be a mapping with name and path")
    unknown = sorted((set(entry) | set(defaults)) - {*PER_DATASET_FIELDS, "name", "path"})
    if unknown:
        raise ConfigError(f"{source}: dataset {entry.get('name', index)!r}: {', '.join(unknown)} not offered per "
                          f"dataset by hpc_rl's eval (it takes {', '.join(PER_DATASET_FIELDS)}); drop them")
    return coerce_value({**defaults, **entry}, EvalDataset, f"{source}: dataset {entry['name']!r}")
