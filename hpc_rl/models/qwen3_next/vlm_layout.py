"""Qwen3.5's released checkpoints are vision-language: their text tower read and written for text-only training.

Owns: recognising the layout (`is_vlm_layout`), a reader that serves a VLM checkpoint's language model under the
text model's names (`TextTowerReader`, the families' `hf_reader` hook: `text_tower_reader`), and writing the trained
text tower back in the reference's layout with the tensors hpc_rl does not train passed through unchanged
(`vlm_state`, the `hf_export` hook). Pure names here; torch and safetensors only inside the functions.

On disk (transformers 5.24's `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`, config.json
model_type qwen3_5 / qwen3_5_moe with `text_config` and `vision_config`):
  model.language_model.{embed_tokens, layers.N.*, norm}   the language model (the text model's `model.*`)
  lm_head.weight                                          the same name in both
  model.visual.*                                          the vision tower (not trained here: kept aside)
  mtp.*                                                   the release's multi-token-prediction layer (likewise)
hpc_rl trains the language model only (text prompts); the vision tower and MTP weights are read from the reference
checkpoint on export and written unchanged, so the exported directory is the same VLM with its language model
trained. Weight syncs send the text names (`model.layers.*`): SGLang 0.5.23's Qwen3.5 VLM loader maps
`model.language_model.` to `model.` and takes `model.*` as is (srt/models/qwen3_5.py `load_weights`), and
transformers' `AutoModelForCausalLM` on such a checkpoint builds the text model (`Qwen3_5ForCausalLM`, names
`model.*`), which the CPU engine serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

TEXT_PREFIX = "model.language_model."
"""Where a VLM release keeps the language model's `model.*` tensors."""
ASIDE_PREFIXES = ("model.visual.", "mtp.")
"""A VLM release's tensors hpc_rl does not train (vision tower, MTP layer): passed through on export."""


def is_vlm_layout(names: Iterable[str]) -> bool:
    """True when the checkpoint's tensor names hold the language model under `model.language_model.`."""
    return any(name.startswith(TEXT_PREFIX) for name in names)


def disk_name(text_name: str) -> str:
    """A text model's tensor name as a VLM release stores it (`model.X` -> `model.language_model.X`)."""
    return TEXT_PREFIX + text_name[len("model."):] if text_name.startswith("model.") else text_name


def text_name(name: str) -> str | None:
    """A VLM release's tensor name as the text model's (None: not the language model's: vision tower, MTP)."""
    if name.startswith(TEXT_PREFIX):
        return "model." + name[len(TEXT_PREFIX):]
    if name.startswith(ASIDE_PREFIXES):
        return None
    return name


class TextTowerReader:
    """A checkpoint reader (`hf_import.HFTensorReader` or a dict) of a VLM release, serving its language model under
    the text model's names; `aside` lists the tensors it does not serve (vision tower, MTP)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._disk = {text: name for name in inner.keys() if (text := text_name(name)) is not None}
        self.aside = sorted(name for name in inner.keys() if text_name(name) is None)

    def keys(self) -> list[str]:
        return list(self._disk)

    def __iter__(self) -> Iterator[str]:
        return iter(self._disk)

    def __contains__(self, name: str) -> bool:
        return name in self._disk

    def __getitem__(self, name: str) -> Any:
        return self.inner[self._disk[name]]


def text_tower_reader(reader: Any, hf_config: Mapping[str, Any]) -> Any:
    """The hybrid families' `hf_reader` hook: a VLM release read through `TextTowerReader`; else the reader as is."""
    return TextTowerReader(reader) if is_vlm_layout(reader.keys()) else reader


def _reference_names(reference_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of the reference checkpoint (its index, else every file's keys)."""
    import json

    from safetensors import safe_open

    index = reference_dir / "model.safetensors.index.json"
    if index.is_file():
        return {name: reference_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    found: dict[str, Path] = {}
    for path in sorted(reference_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            found.update({name: path for name in handle.keys()})  # noqa: SIM118 - not a dict
    return found


def vlm_state(state: dict[str, Any], arch: Any, reference_dir: Path | None) -> dict[str, Any]:
    """The hybrid families' `hf_export` hook. With a VLM release as the reference: the text tower under
    `model.language_model.`, and (once, with the part holding the embedding: the first pipeline stage's) the
    reference's vision tower and MTP tensors unchanged; otherwise `state` as is."""
    if reference_dir is None or not reference_dir.is_dir():
        return state
    names = _reference_names(reference_dir)
    if not is_vlm_layout(names):
        return state
    out = {disk_name(name): tensor for name, tensor in state.items()}
    if "model.embed_tokens.weight" in state:
        from safetensors import safe_open

        for name in sorted(n for n in names if text_name(n) is None):
            with safe_open(str(names[name]), framework="pt") as handle:
                out[name] = handle.get_tensor(name)
    return out
