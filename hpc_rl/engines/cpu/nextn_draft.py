"""The MTP (NextN) layers of a DeepSeek-V3 / GLM-4.7-Flash checkpoint in the CPU engine, as SGLang's draft holds them.

Owns: which HF names SGLang 0.5.23 gives its EAGLE/NextN draft model (`DeepseekV3ForCausalLMNextN`,
`Glm4MoeLiteForCausalLMNextN`: the checkpoint's `model.layers.<num_hidden_layers + k>.*`, except the
per-MTP-layer `embed_tokens` and `shared_head.head` copies, which both the target and the draft skip: the
draft uses the target's embedding and head), reading them from the checkpoint at start, and keeping them
beside the model (`draft_tensors`) so that weight updates reach them by name, with shapes checked, and
`/get_weights_by_name` reads them. The CPU engine does not draft (speculative decoding changes SGLang's speed,
not the distribution it samples); it holds these weights so that the trainer's MTP sync is received and
checked exactly where SGLang's draft receives it. transformers' DeepseekV3ForCausalLM itself drops these
layers at load (`_keys_to_ignore_on_load_unexpected`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

NEXTN_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")
ATTRIBUTE = "nextn_draft_tensors"


def nextn_layers(config: dict) -> tuple[int, int]:
    """(first MTP layer index, MTP layer count) of a config.json (0 layers: no draft)."""
    architectures = config.get("architectures") or []
    if not any(name in NEXTN_ARCHITECTURES for name in architectures):
        return 0, 0
    count = int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)
    return int(config["num_hidden_layers"]), count


def is_draft_name(name: str, first: int, count: int) -> bool:
    match = _LAYER_NAME.match(name)
    return match is not None and first <= int(match.group(1)) < first + count


def skipped_by_sglang(name: str, first: int, count: int) -> bool:
    """An MTP layer's embedding / head copy: SGLang's target and draft both skip it."""
    return is_draft_name(name, first, count) and name.endswith(SHARED_WITH_TARGET)


def load_draft_tensors(model_path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The checkpoint's NextN layer tensors by HF name, in the engine's dtype (empty without MTP layers)."""
    from safetensors import safe_open

    first, count = checkpoint_nextn_layers(model_path)
    if not count:
        return {}
    tensors = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - not a dict
                if is_draft_name(name, first, count) and not skipped_by_sglang(name, first, count):
                    tensors[name] = handle.get_tensor(name).to(dtype)
    return tensors


def checkpoint_nextn_layers(model_path: str | Path) -> tuple[int, int]:
    return nextn_layers(json.loads((Path(model_path) / "config.json").read_text()))


def attach_draft(model: torch.nn.Module, model_path: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Read the NextN layers and keep them on the model (`draft_tensors`), with where they sit."""
    setattr(model, ATTRIBUTE, (checkpoint_nextn_layers(model_path), load_draft_tensors(model_path, dtype)))


def draft_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return getattr(model, ATTRIBUTE, ((0, 0), {}))[1]


def ignored_update(model: torch.nn.Module, name: str) -> bool:
    """A weight-update name SGLang drops without loading it (an MTP layer's embedding / head copy)."""
    (first, count), _ = getattr(model, ATTRIBUTE, ((0, 0), {}))
    return bool(count) and skipped_by_sglang(name, first, count)
