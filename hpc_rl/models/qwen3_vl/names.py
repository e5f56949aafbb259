"""Qwen3-VL's HF <-> Megatron names and layouts: the language model under `model.language_model.`, the vision tower
(patch embed, position grid, blocks, merger, deepstack mergers) under `model.visual.`, the fused experts of the MoE
release, and the architecture fields read from config.json.

Owns: `architecture_fields_from_hf` (config.json -> ModelArchitecture fields, `vision_config` included),
`vision_param_names` (the tower's tensors, from a meta-device build of transformers' module), the family hooks
`vision_rows` (hf_extra_rows: `vision_model.<n>` <-> `model.visual.<n>`, identity layout, replicated over TP),
`to_megatron` / `to_hf` (the identity for the tower; None for the language model, whose rows are the shared Qwen3 /
Qwen3-MoE ones under the family's `hf_text_prefix`), and `FusedExpertReader`, which serves a Qwen3-VL-MoE
checkpoint's fused `mlp.experts.gate_up_proj` / `down_proj` under the shared per-expert names.

Experts: the released Qwen3-VL-MoE checkpoints hold each layer's experts fused, `gate_up_proj` [E, H, 2I] (x @ W,
gate in the first I columns) and `down_proj` [E, I, H]; transformers 5.24's `save_pretrained` writes its in-memory
[E, 2I, H] / [E, H, I] instead, and reads both. The reader takes either (told apart by shape; H == 2I would be
ambiguous and is refused). Exports and weight syncs send per-expert names
(`model.language_model.layers.L.mlp.experts.G.{gate,up,down}_proj.weight`), which SGLang 0.5.23's
`Qwen3VLMoeForConditionalGeneration.load_weights` reads through its per-expert mapping (read in the installed
wheel: it switches to the fused mapping only for names holding `experts.gate_up_proj` / `experts.down_proj`).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from hpc_rl.models.registry import NameRow

VISION_MEGATRON = "vision_model."
VISION_HF = "model.visual."
TEXT_HF = "model.language_model."
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def architecture_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelArchitecture fields of a Qwen3-VL / Qwen3-VL-MoE config.json (the text model's shape, the MoE routing,
    and `vision_config` with image_token_id and mrope_section)."""
    model_type = hf.get("model_type")
    if model_type not in ("qwen3_vl", "qwen3_vl_moe"):
        raise ValueError(f"config.json model_type {model_type!r}: not a Qwen3-VL checkpoint")
    text = hf["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    mrope = rope.get("mrope_section")
    if not mrope or not rope.get("mrope_interleaved", True):
        raise ValueError("config.json text_config.rope_parameters: Qwen3-VL needs mrope_section with "
                         "mrope_interleaved true")
    fields: dict[str, Any] = dict(
        family=model_type, num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
        ffn_hidden_size=text["intermediate_size"], num_attention_heads=text["num_attention_heads"],
        num_query_groups=text.get("num_key_value_heads") or text["num_attention_heads"],
        kv_channels=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
        vocab_size=text["vocab_size"], rotary_base=float(rope.get("rope_theta", text.get("rope_theta", 5e6))),
        norm_epsilon=text.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qk_layernorm=True, max_position_embeddings=text.get("max_position_embeddings", 128000),
        vision_config={**hf["vision_config"], "image_token_id": hf["image_token_id"], "mrope_section": list(mrope)},
    )
    if model_type == "qwen3_vl_moe":
        fields.update(num_moe_experts=text.get("num_experts", text.get("num_local_experts")), moe_ffn_hidden_size=text["moe_intermediate_size"],
                      moe_router_topk=text["num_experts_per_tok"], moe_router_score_function="softmax",
                      moe_router_pre_softmax=not text.get("norm_topk_prob", True))
        dense = set(text.get("mlp_only_layers") or [])
        step = text.get("decoder_sparse_step", 1)
        layers = [int(i not in dense and (i + 1) % step == 0) for i in range(text["num_hidden_layers"])]
        if not all(layers):
            fields["moe_layer_freq"] = layers
    return fields


@lru_cache(maxsize=8)
def _vision_names(key: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    import torch

    from hpc_rl.models.qwen3_vl.vision import build_vision_tower

    tower = build_vision_tower(json.loads(key), dtype=torch.float32, device="meta")
    return tuple((name, tuple(p.shape)) for name, p in tower.named_parameters())


def vision_param_names(vision_config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name under the tower, shape) of every tensor of the tower `vision_config` describes, in module order."""
    return list(_vision_names(json.dumps(vision_config, sort_keys=True)))


def vision_rows(arch: Any, last_layer_rows: list[NameRow]) -> list[NameRow]:
    """The family's hf_extra_rows hook: every tower tensor, `vision_model.<n>` <-> `model.visual.<n>`."""
    if not arch.vision_config:
        raise ValueError(f"model family {arch.family}: set vision_config in the model file (config.json's "
                         f"vision_config with image_token_id and mrope_section; see "
                         f"hpc_rl.models.qwen3_vl.names.architecture_fields_from_hf)")
    return [(VISION_MEGATRON + name, [VISION_HF + name]) for name, _ in vision_param_names(arch.vision_config)]


def to_megatron(name: str, hf_tensors: Any, arch: Any) -> Any:
    """The to_megatron hook: a tower tensor as it is; None (the shared layouts) for the language model."""
    return hf_tensors[0] if name.startswith(VISION_MEGATRON) else None


def to_hf(name: str, full: Any, arch: Any) -> list[tuple[str, Any]] | None:
    """The to_hf hook: a tower tensor under `model.visual.`; None for the language model."""
    return [(VISION_HF + name[len(VISION_MEGATRON):], full)] if name.startswith(VISION_MEGATRON) else None


class FusedExpertReader:
    """A checkpoint reader (`hf_import.HFTensorReader` or a dict) that also serves fused experts under the
    per-expert names (`arch`: hidden size and moe_ffn_hidden_size tell the two fused layouts apart)."""

    def __init__(self, inner: Any, arch: Any) -> None:
        self.inner = inner
        self.hidden, self.inter = arch.hidden_size, arch.moe_ffn_hidden_size
        if self.hidden == 2 * self.inter:
            raise ValueError(f"hidden_size {self.hidden} == 2 * moe_ffn_hidden_size: the fused expert layouts "
                             f"cannot be told apart by shape")
        self._cache: tuple[str, Any] | None = None

    def keys(self) -> list[str]:
        names = []
        for name in self.inner.keys():
            fused = _FUSED.match(name)
            if fused is None:
                names.append(name)
                continue
            count = self._fused(name).shape[0]
            parts = ("gate_proj", "up_proj") if fused.group(2) == "gate_up_proj" else ("down_proj",)
            names += [f"{fused.group(1)}{g}.{part}.weight" for g in range(count) for part in parts]
        return names

    def __contains__(self, name: str) -> bool:
        if name in self.inner:
            return True
        match = _PER_EXPERT.match(name)
        if match is None:
            return False
        fused = match.group(1) + ("down_proj" if match.group(3) == "down_proj" else "gate_up_proj")
        return fused in self.inner and int(match.group(2)) < self._fused(fused).shape[0]

    def __getitem__(self, name: str) -> Any:
        match = _PER_EXPERT.match(name)
        if match is None or name in self.inner:
            return self.inner[name]
        expert, part = int(match.group(2)), match.group(3)
        fused = self._fused(match.group(1) + ("down_proj" if part == "down_proj" else "gate_up_proj"))[expert]
        if part == "down_proj":  # [I, H] released, [H, I] transformers' -> Megatron/nn.Linear [H, I]
            return fused.t().contiguous() if fused.shape == (self.inter, self.hidden) else fused
        if fused.shape == (self.hidden, 2 * self.inter):  # released: x @ W
            fused = fused.t()
        return (fused[: self.inter] if part == "gate_proj" else fused[self.inter:]).contiguous()

    def _fused(self, name: str) -> Any:
        if self._cache is None or self._cache[0] != name:
            self._cache = (name, self.inner[name])
        return self._cache[1]


def fused_state(state: dict[str, Any], arch: Any) -> dict[str, Any]:
    """An exported HF state with each layer's per-expert tensors fused as the Qwen3-VL-MoE release holds them
    (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]), for HF checkpoints written by the converter and --save-hf
    (transformers and SGLang read that layout; transformers 5.24 reads no per-expert names for this model)."""
    import torch

    experts = arch.num_moe_experts or 0
    out: dict[str, Any] = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        if int(match.group(2)) != 0 or match.group(3) == "up_proj":
            continue  # fused when expert 0's gate / down is met
        prefix = match.group(1)
        if match.group(3) == "gate_proj":
            out[prefix + "gate_up_proj"] = torch.stack([
                torch.cat([state[f"{prefix}{g}.gate_proj.weight"], state[f"{prefix}{g}.up_proj.weight"]]).t()
                for g in range(experts)]).contiguous()
        else:
            out[prefix + "down_proj"] = torch.stack([state[f"{prefix}{g}.down_proj.weight"].t()
                                                     for g in range(experts)]).contiguous()
    return out


VL_MODEL_TYPES = {"qwen3": "qwen3_vl", "qwen3_moe": "qwen3_vl_moe"}
"""The text family Megatron's flags describe -> the VL family, when config.json is a Qwen3-VL one."""


def is_vl_config(hf: dict[str, Any] | None) -> bool:
    """config.json is a Qwen3-VL / Qwen3-VL-MoE checkpoint's."""
    return bool(hf) and hf.get("model_type") in VL_MODEL_TYPES.values() and isinstance(hf.get("text_config"), dict)


def text_view(hf: dict[str, Any]) -> dict[str, Any]:
    """A VL config.json's language-model keys at the top level (what the text families' rules read)."""
    return {**hf["text_config"], "model_type": hf["model_type"]}


def apply_vl_fields(fields: dict[str, Any], hf: dict[str, Any], problems: list[str]) -> None:
    """Turn the architecture Megatron's flags describe (Qwen3 / Qwen3-MoE) into the VL family of `hf` (a Qwen3-VL
    config.json): the family and `vision_config`; a problem when the flags describe another family."""
    family = fields.get("family", "")
    wanted = family if family in VL_MODEL_TYPES.values() else VL_MODEL_TYPES.get(family)
    if wanted != hf["model_type"]:
        problems.append(f"config.json is a {hf['model_type']} checkpoint but the model flags describe a "
                        f"{fields.get('family')} language model (expected {hf['model_type'].replace('_vl', '')}'s)")
        return
    fields["family"] = wanted
    fields["vision_config"] = architecture_fields_from_hf(hf)["vision_config"]


def read_fused_experts(reader: Any, hf_config: dict[str, Any]) -> Any:
    """The MoE family's `hf_reader` hook: fused experts (released or transformers' layout) under per-expert names."""
    from types import SimpleNamespace

    text = hf_config.get("text_config") or hf_config
    return FusedExpertReader(reader, SimpleNamespace(hidden_size=text["hidden_size"],
                                                     moe_ffn_hidden_size=text["moe_intermediate_size"]))


def released_state(state: dict[str, Any], arch: Any, reference_dir: Any = None) -> dict[str, Any]:
    """The MoE family's `hf_export` hook: experts fused as the release holds them (`fused_state`)."""
    return fused_state(state, arch)
