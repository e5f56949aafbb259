"""Model families, one folder each (`hpc_rl/models/<family>/`), found through one registry (`registry`).

A family is data plus a few hooks: its config.json rules, its HF <-> Megatron name rows, its layer-spec choice,
its tiny checkpoint maker and the CPU engine's loader. See docs/architecture.md, "Adding a family".
"""

from hpc_rl.models.registry import (
    LazyHook,
    ModelFamily,
    NameRow,
    all_families,
    family,
    family_for_hf_model_type,
    family_for_slime_spec,
    family_names,
    lazy_hook,
    register,
)

__all__ = ["LazyHook", "ModelFamily", "NameRow", "all_families", "family", "family_for_hf_model_type",
           "family_for_slime_spec", "family_names", "lazy_hook", "register"]
