"""The typed config tree of one run: `RunConfig`, the table of its sections, each a `@dataclass(kw_only=True)`.

Owns: the section table (which section name holds which dataclass) and the top-level fields (model, model_args,
run_dir). The sections themselves (field names: slime's flag names, so recipes move over; defaults, types and the
invariants a single section can check by itself in `__post_init__`) live in `hpc_rl.config.sections.*`, one module
per group of sections. Cross-section rules, file checks and plug-in checks live in `hpc_rl.config.validation`;
YAML/CLI merging in `hpc_rl.config.loading`. Each field's docstring (the string literal after it) is its `--help` text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.config.lora import LoraConfig
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.sections.algorithm import AlgorithmConfig, DistillationConfig
from hpc_rl.config.sections.cluster import ClusterConfig, ControllerConfig, LoggingConfig, SlurmConfig
from hpc_rl.config.sections.rollout import EvalConfig, RolloutConfig, SGLangConfig
from hpc_rl.config.sections.training import CheckpointConfig, CriticConfig, OptimizerConfig, TrainingConfig


@dataclass(kw_only=True)
class RunConfig:
    """One complete run: every section plus the model architecture file."""

    model: str = ""
    """Path of the model architecture file (configs/models/*.yaml); optional with Megatron's model flags."""
    model_args: ModelArchitecture | None = None
    """The architecture from Megatron's model flags (slime's MODEL_ARGS: --num-layers 36 ...), on top of
    the model file when both are given; written to <run_dir>/model.yaml at submit."""
    run_dir: str = ""
    """Directory of every artifact of the run (default: runs/<run_name>-<timestamp>)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def section_fields(self) -> Iterator[tuple[str, str, Any]]:
        """(section, field, value) of every field of every section (model_args included when set)."""
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            if dataclasses.is_dataclass(value):
                for item in dataclasses.fields(value):
                    yield section.name, item.name, getattr(value, item.name)
