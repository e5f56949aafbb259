"""The `args` namespace handed to user plug-ins (slime passes its flat argparse namespace).

Owns: flattening a `RunConfig` into one `SimpleNamespace` with slime's flag names
(`args.rollout_batch_size`, `args.n_samples_per_prompt`, `args.sglang_mem_fraction_static`, ...),
so a slime filter / reward / generate function reads the same attribute names here.
"""

from __future__ import annotations

from types import SimpleNamespace

from hpc_rl.config.schema import RunConfig


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
    return SimpleNamespace(**flat)
