"""The `args` namespace handed to user plug-ins (slime passes its flat argparse namespace).

Owns: flattening a `RunConfig` into one `SimpleNamespace` with slime's flag names
(`args.rollout_batch_size`, `args.n_samples_per_prompt`, `args.sglang_mem_fraction_static`, ...),
so a slime filter / reward / generate function reads the same attribute names here, plus the values of
`rollout.custom_config_path` (slime's --custom-config-path: a YAML mapping, read where the plug-ins run).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from hpc_rl.config.schema import RunConfig


def custom_config_values(path: str | Path) -> dict[str, Any]:
    """The mapping of a --custom-config-path file (ValueError naming the file when it is not one)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"rollout.custom_config_path {path}: cannot be read as YAML: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"rollout.custom_config_path {path}: the top level must be a mapping of names to values")
    return {str(key): value for key, value in data.items()}


def plugin_args(config: RunConfig) -> SimpleNamespace:
    """Every field of every section as a flat attribute (sglang fields also with the sglang_ prefix)."""
    flat: dict[str, object] = {"model": config.model, "run_dir": config.run_dir}
    for section, name, field_value in config.section_fields():
        flat.setdefault(name, field_value)
        if section == "sglang":
            flat[f"sglang_{name}"] = field_value
    for key, extra in config.sglang.extra_args.items():
        flat[f"sglang_{key}"] = extra
    flat["eval_prompt_data"] = [x for d in config.eval.eval_prompt_data for x in (d.name, d.path)]
    if config.rollout.custom_config_path:
        flat.update(custom_config_values(config.rollout.custom_config_path))
    return SimpleNamespace(**flat)
