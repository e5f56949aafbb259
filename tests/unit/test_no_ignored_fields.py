"""Issue 10 item 5: no config field is accepted and ignored.

Every field of every section must be read by name somewhere in hpc_rl outside `hpc_rl/config/` (the
config package only loads, derives and checks values), or be listed below with what reads it. A new
field that nothing reads fails this test.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hpc_rl.config.schema import RunConfig

PACKAGE = Path(__file__).resolve().parents[2] / "hpc_rl"

# Fields read other than by `.name` outside hpc_rl/config/, with what reads them.
READ_ELSEWHERE = {
    "model_args": "write_resolved_config writes it to <run_dir>/model.yaml, the `model` file every process reads",
    "max_turns": "custom generate functions read args.max_turns (plugin_args); validation requires that plug-in",
    "global_batch_size": "sets num_steps_per_rollout (derived as slime does in config/loading.py; validation checks "
                         "rollout_batch_size * n_samples_per_prompt == global_batch_size * num_steps_per_rollout)",
    "extra_args": "read through SGLangConfig.server_options() (launch/driver.py passes them to every engine)",
    "megatron_config_path": "slime's role file, read when the config is built (config/training_modes.apply_role_file) "
                            "into critic_optimizer / critic_load / critic_save and the actor's optimizer and checkpoint",
    "gpu_memory_gib": "read by the per-GPU memory plan (config/memory_plan.py) that submit checks and --dry-run prints",
    # slime flags of issue 26
    "custom_config_path": "config.plugin_args reads the file into the `args` every plug-in receives (controller and "
                          "trainer processes both build it there)",
    "update_weight_mode": "slime's full|delta: validation refuses delta, and full is what every sync does",
    # miles' LoRA flags of issue 33
    "exclude_modules": "config.lora.target_projections subtracts it from target_modules; training/lora/attach.py "
                       "adapts what that returns (adapted_layers)",
    "model_name": "slime's model family name: validation checks it names the architecture's family, which is what "
                  "the weight conversion follows",
}


def _sources_outside_config() -> str:
    return "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if "config" not in p.relative_to(PACKAGE).parts[:1])


def _all_fields() -> list[tuple[str, str]]:
    fields = []
    for top in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(top.type) or top.name not in ("model", "run_dir", "model_args"):
            section_type = RunConfig.__dataclass_fields__[top.name].default_factory  # type: ignore[misc]
            fields += [(top.name, f.name) for f in dataclasses.fields(section_type())]
        else:
            fields.append(("", top.name))
    return fields


def _read_by_name(name: str, source: str) -> bool:
    return re.search(rf"(\.{name}\b|[\"']{name}[\"'])", source) is not None


def test_every_field_is_read_somewhere() -> None:
    source = _sources_outside_config()
    unread = [f"{section}.{name}" if section else name for section, name in _all_fields()
              if name not in READ_ELSEWHERE and not _read_by_name(name, source)]
    assert not unread, f"config fields accepted but never read outside hpc_rl/config/: {unread}"


def test_the_exceptions_are_still_needed() -> None:
    """An exception whose field is now read by name (or no longer exists) must leave READ_ELSEWHERE."""
    source = _sources_outside_config()
    names = {name for _, name in _all_fields()}
    stale = [name for name in READ_ELSEWHERE if name not in names or _read_by_name(name, source)]
    assert not stale, f"drop these from READ_ELSEWHERE: {stale}"
