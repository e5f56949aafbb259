"""slime's gpt-oss model flags (scripts/models/gpt-oss-20B.sh) with Megatron's meanings. Pure: no torch.

Owns: the Megatron flags only gpt-oss uses (`--softmax-type`, `--window-size`, `--window-attn-skip-freq`,
`--quick-geglu`, `--glu-linear-offset`, `--activation-func-clamp-value`, `--position-embedding-type yarn` with
`--rotary-scaling-factor` / `--yarn-original-max-position-embeddings`), slime's spec for it, and turning them into
ModelArchitecture fields (`apply_gpt_oss_flags`, called by `hpc_rl.config.megatron_model`). The flags keep
Megatron's meanings; config.json's check (`architecture.gpt_oss_mismatches`) then names any disagreement with the
checkpoint. Two of slime's gpt-oss line disagree with openai/gpt-oss-20b that way:

* `--window-size 128,0` is 129 keys in Megatron (i-128..i); the checkpoint's sliding_window 128 is 128 keys:
  `--window-size 127,0` (Megatron-Bridge's gpt-oss provider uses sliding_window - 1 too).
* `--position-embedding-type rope --use-rope-scaling --rope-scaling-factor 32` is Megatron's Llama-3.1 frequency
  scaling (no YaRN ramp, no 0.1 ln 32 + 1 cos/sin factor); the checkpoint's rope_parameters are YaRN:
  `--position-embedding-type yarn --rotary-scaling-factor 32` (YaRN's other numbers then come from config.json, or
  gpt-oss's defaults: original context 4096, beta 32 / 1, no rounding).
"""

from __future__ import annotations

from typing import Any

GPT_OSS_SPEC = ("slime_plugins.models.gpt_oss", "get_gpt_oss_spec")
GPT_OSS_MODEL_VALUE_FLAGS: dict[str, Any] = {
    "softmax_type": str,
    "window_size": Any,  # "128,0" on a command line, a list in YAML
    "window_attn_skip_freq": Any,  # an int or a 0/1 list expression, parsed as --moe-layer-freq is (settings_sources)
    "glu_linear_offset": float,
    "activation_func_clamp_value": float,
    "yarn_original_max_position_embeddings": int,
}
GPT_OSS_MODEL_SWITCHES = ("quick_geglu",)
YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                 "yarn_correction_range_round_to_int": False}
"""GptOssConfig's rope_parameters defaults, for a line checked without config.json (--no-check-files)."""
USE_ROPE_SCALING_REASON = (
    "Megatron's --use-rope-scaling is Llama 3.1's frequency scaling, which is not what any checkpoint hpc_rl builds "
    "computes (gpt-oss's config.json is YaRN: give --position-embedding-type yarn --rotary-scaling-factor 32 instead "
    "of --position-embedding-type rope --use-rope-scaling --rope-scaling-factor 32); a scaled RoPE that differs from "
    "the engine's would train silently wrong")


def _window_size(value: Any, problems: list[str]) -> list[int] | None:
    parts = value if isinstance(value, list) else str(value).replace("(", "").replace(")", "").split(",")
    try:
        window = [int(str(part).strip()) for part in parts]
    except ValueError:
        window = []
    if len(window) != 2:
        problems.append(f"--window-size {value!r}: expected Megatron's LEFT,RIGHT (gpt-oss: 127,0)")
        return None
    return window


def gpt_oss_flags_given(flags: dict[str, Any]) -> list[str]:
    """The gpt-oss flags among `flags`."""
    return [name for name in (*GPT_OSS_MODEL_VALUE_FLAGS, *GPT_OSS_MODEL_SWITCHES) if name in flags]


def apply_gpt_oss_flags(flags: dict[str, Any], fields: dict[str, Any], problems: list[str],
                        hf_config: dict[str, Any] | None) -> None:
    """The gpt-oss flags on top of `fields` (a gpt-oss line: slime's spec or config.json's model_type)."""
    if "softmax_type" in flags:
        fields["softmax_type"] = flags["softmax_type"]
    if "window_size" in flags:
        fields["window_size"] = _window_size(flags["window_size"], problems)
    if "window_attn_skip_freq" in flags:
        fields["window_attn_skip_freq"] = flags["window_attn_skip_freq"]
    if flags.get("quick_geglu"):
        fields["quick_geglu"] = True
    for name in ("glu_linear_offset", "activation_func_clamp_value"):
        if name in flags:
            fields[name] = flags[name]
    if flags.get("position_embedding_type") == "yarn":
        from hpc_rl.models.mla import hf_rope_scaling, hf_yarn_fields

        fields.update(YARN_DEFAULTS)
        if hf_config is not None:
            fields.update(hf_yarn_fields(hf_config))
            scaling = hf_rope_scaling(hf_config)
            if "truncate" in scaling:
                fields["yarn_correction_range_round_to_int"] = bool(scaling["truncate"])
        if "yarn_original_max_position_embeddings" in flags:
            fields["original_max_position_embeddings"] = flags["yarn_original_max_position_embeddings"]
        if "rotary_scaling_factor" in flags:
            fields["rotary_scaling_factor"] = flags["rotary_scaling_factor"]
    elif "rotary_scaling_factor" in flags or "yarn_original_max_position_embeddings" in flags:
        problems.append("--rotary-scaling-factor / --yarn-original-max-position-embeddings without "
                        "--position-embedding-type yarn: Megatron ignores them; add --position-embedding-type yarn")


class GptOssFlags:
    """The family's `megatron_flags` (hpc_rl.models.registry.FamilyFlags)."""

    def given(self, flags: dict[str, Any]) -> list[str]:
        return gpt_oss_flags_given(flags)

    def apply(self, flags: dict[str, Any], fields: dict[str, Any], problems: list[str],
              hf_config: dict[str, Any] | None) -> None:
        apply_gpt_oss_flags(flags, fields, problems, hf_config)
