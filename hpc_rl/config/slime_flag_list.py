"""slime's own flags, as THUDM/slime's `slime/utils/arguments.py` defines them at one commit.

Owns: reading `slime_arguments.tsv` beside this file (one line per flag: name, slime's argument group, whether it
takes a value, its type, choices and default; regenerated from slime's source by tools/list_slime_flags.py), the
slime commit it came from, and slime's groups in slime's order with a title each. What hpc_rl does with each flag
is `slime_flags`' tables and the schema's fields (`help_text.slime_flag_status` reads them); this module only
knows slime's side.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

SLIME_ARGUMENTS_LIST = Path(__file__).with_name("slime_arguments.tsv")

GROUP_TITLES = {
    "cluster": "cluster (GPUs, colocation, offload)",
    "train": "training backend",
    "rollout": "rollout (generation, filters, weight updates)",
    "fault_tolerance": "fault tolerance",
    "data": "data and batch sizes",
    "eval": "evaluation",
    "algo": "algorithm (checkpoints, loss, advantages)",
    "on_policy_distillation": "on-policy distillation",
    "wandb": "Weights & Biases and rollout metrics",
    "tensorboard": "TensorBoard",
    "debug": "debugging and profiling",
    "network": "network",
    "reward_model": "reward model",
    "rollout_buffer": "rollout buffer and sample plug-ins",
    "mtp_training": "multi-token prediction",
    "ci": "slime's CI",
    "custom_megatron_plugins": "Megatron plug-ins",
    "misc": "misc",
    "mode": "run mode (parsed first by slime)",
}
"""slime's argument groups (its `add_<group>_arguments` functions), in the order slime adds them."""


@dataclass(frozen=True)
class SlimeFlag:
    """One flag of slime's arguments.py."""

    flag: str
    """As typed: --rollout-batch-size."""
    group: str
    """slime's argument group (a key of GROUP_TITLES)."""
    kind: str
    """switch (no value) | value | values (one or more)."""
    type: str
    """The declared type's name: int, float, str, json, bool."""
    choices: tuple[str, ...]
    default: str
    """repr of slime's default ('' when None)."""

    @property
    def name(self) -> str:
        """The flag as a config key: rollout_batch_size."""
        return self.flag[2:].replace("-", "_")

    def line(self) -> str:
        return "\t".join((self.flag, self.group, self.kind, self.type, "|".join(self.choices), self.default))

    @classmethod
    def from_line(cls, line: str) -> SlimeFlag:
        flag, group, kind, type_name, choices, default = line.rstrip("\n").split("\t")
        return cls(flag=flag, group=group, kind=kind, type=type_name,
                   choices=tuple(choices.split("|")) if choices else (), default=default)


@functools.cache
def slime_flag_list(path: Path = SLIME_ARGUMENTS_LIST) -> tuple[SlimeFlag, ...]:
    """Every flag of the list, in slime's definition order."""
    return tuple(SlimeFlag.from_line(line) for line in path.read_text().splitlines()
                 if line and not line.startswith("#"))


def slime_list_source(path: Path = SLIME_ARGUMENTS_LIST) -> tuple[str, str]:
    """(commit, date) of the slime source the list came from (its first header line)."""
    _repo, commit, date = path.read_text().splitlines()[0].removeprefix("# ").split()[:3]
    return commit, date.strip("()")


SLIME_LATER_FLAGS: tuple[SlimeFlag, ...] = tuple(SlimeFlag.from_line(line) for line in (
    "--flush-cache-interval\trollout\tvalue\tint\t\t1",
    "--buffer-sort-by-staleness\trollout\tswitch\tbool\t\t",
    "--pg-loss-type\talgo\tvalue\tstr\tppo|reinforce\t",
    "--use-score-centering\talgo\tswitch\tbool\t\t",
    "--score-centering-top-k\talgo\tvalue\tint\t\t128",
    "--routing-replay-prefetch-microbatches\talgo\tvalue\tint\t\t1",
    "--force-fp8-ue8m0-scale\ttrain\tswitch\tbool\t\tFalse",
    "--use-gated-attention\tmisc\tswitch\tbool\t\t",
    "--post-self-attn-layernorm\tmisc\tswitch\tbool\t\t",
    "--post-mlp-layernorm\tmisc\tswitch\tbool\t\t",
    "--rollout-session-id\trollout\tvalue\tstr\t\t",
    "--rollout-cleanup-timeout\trollout\tvalue\tfloat\t\t",
    "--rollout-data-dir\trollout\tvalue\tstr\t\t",
    "--rollout-storage-profile\trollout\tvalue\tstr\t\t",
    "--rollout-storage-declaration\trollout\tvalue\tstr\t\t",
    "--rollout-queue-run-id\trollout\tvalue\tstr\t\t",
    "--rollout-queue-online-gc\trollout\tswitch\tbool\t\t",
    "--rollout-queue-lease-seconds\trollout\tvalue\tfloat\t\t",
    "--rollout-queue-segment-mib\trollout\tvalue\tint\t\t",
    "--rollout-io-concurrency\trollout\tvalue\tint\t\t",
))
"""Issue 34: flags slime's main added after the list's commit (the issue's list; kinds, types and defaults from a
public copy of the later arguments.py where it has them). The list above is not regenerated yet: the later commit
(0b0c277d) is not in the slime mirror tools/list_slime_flags.py reads. The flag walk tries these too."""
SLIME_LATER_VALUES: dict[str, tuple[str, ...]] = {"--rollout-data-transport": ("straw",)}
"""Values slime's later main added to a listed flag's choices (the walk tries each)."""
