"""The run's model, resolved once per validation: its architecture and its HF checkpoint's config.json.

Owns: `ResolvedModel` and `resolve_model(config)`, which reads the architecture (Megatron's model flags first, else
the model file) and `checkpoint.hf_checkpoint`'s config.json once each, for every check that needs them
(`model_checks`, `moe_checks`, `mtp_checks`, `memory_plan`, `lora_checks`, `slime_flag_checks`, the FP8 check);
`run_architecture(config)` for callers outside validation (submit's memory plan, tests). Before this module,
validation read the model file 4 times and config.json twice per run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig


@dataclass(frozen=True)
class ResolvedModel:
    """What validation knows of the run's model, read once."""

    arch: ModelArchitecture | None
    """The architecture (None: none given, or its file is missing or bad: `problems` says which)."""
    source: str = ""
    """Where the architecture came from, for messages: "the model flags" or the model file's path."""
    problems: list[Problem] = field(default_factory=list)
    """Why there is no architecture."""
    hf_config_path: Path | None = None
    """checkpoint.hf_checkpoint's config.json when the file is there."""
    hf_config: dict[str, Any] | None = None
    """Its contents (None: no such file, or not valid JSON: `hf_config_error`)."""
    hf_config_error: str | None = None
    """Why config.json could not be read as JSON."""


def _architecture(config: RunConfig) -> tuple[ModelArchitecture | None, str, list[Problem]]:
    if config.model_args is not None:
        return config.model_args, "the model flags", []
    if not config.model:
        return None, "", [Problem("model", "needs",
                                  "no model architecture: give Megatron's model flags (slime's "
                                  "MODEL_ARGS, e.g. --num-layers 36 ...) or model: configs/models/<name>.yaml")]
    model_path = Path(config.model)
    if not model_path.is_file():
        return None, "", [Problem("model", "not_found", f"model file {model_path} not found")]
    try:
        return ModelArchitecture.from_yaml(model_path), str(model_path), []
    except ValueError as error:
        return None, "", [Problem("model", "bad_file", str(error))]


def resolve_model(config: RunConfig) -> ResolvedModel:
    """Read the run's architecture and its HF config.json, once."""
    arch, source, problems = _architecture(config)
    checkpoint = config.checkpoint.hf_checkpoint
    path = Path(checkpoint) / "config.json" if checkpoint else None
    if path is None or not path.is_file():
        return ResolvedModel(arch, source, problems)
    try:
        return ResolvedModel(arch, source, problems, path, json.loads(path.read_text()))
    except (OSError, ValueError) as error:
        return ResolvedModel(arch, source, problems, path, None, str(error))


def run_architecture(config: RunConfig) -> ModelArchitecture | None:
    """The run's architecture (model flags, else the model file), or None when neither gives one."""
    return _architecture(config)[0]
