"""Image prompts for Qwen-VL checkpoints: the chat messages with image items, and the image pad tokens expanded.

Owns: splitting a prompt at slime's `<image>` placeholders into chat content items (slime's `_build_messages`:
each placeholder takes the next image of the row, in order; counts must agree), the size rule of Qwen's image
processor (`smart_resize`, read from transformers' Qwen2-VL processor: both sides multiples of patch x merge,
pixels within the checkpoint's shortest/longest edge), how many `<|image_pad|>` tokens an image becomes
(grid t*h*w / merge^2) and expanding each `<|vision_start|><|image_pad|>+<|vision_end|>` run of the templated
prompt to that count. The controller does this without torch: the ids it sends are the ids the engine and the
trainer see. `tests/unit/test_vision_prompts.py` checks the count against transformers' processor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rl.data.images import MEDIA_KINDS

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


class VisionPromptError(ValueError):
    """A prompt whose placeholders and images disagree, or a checkpoint without what image prompts need."""


@dataclass(frozen=True)
class ImageGrid:
    """The checkpoint's image processor sizes (preprocessor_config.json)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_checkpoint(cls, hf_checkpoint: str | Path) -> "ImageGrid":
        path = Path(hf_checkpoint) / "preprocessor_config.json"
        if not path.is_file():
            raise VisionPromptError(f"{path} does not exist: image prompts (multimodal_keys) need the checkpoint's "
                                    "image processor config")
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        return cls(patch_size=int(raw["patch_size"]), merge_size=int(raw["merge_size"]),
                   temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
                   min_pixels=int(raw.get("min_pixels") or size["shortest_edge"]),
                   max_pixels=int(raw.get("max_pixels") or size["longest_edge"]))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """Qwen's smart_resize: (height, width) multiples of patch*merge, pixels within [min, max]."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > 200:
            raise VisionPromptError(f"an image of {width}x{height}: aspect ratio over 200 (Qwen's image processor "
                                    "refuses it)")
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def image_tokens(self, width: int, height: int) -> int:
        """`<|image_pad|>` tokens of one image: grid (1, h/patch, w/patch) merged merge x merge."""
        h_bar, w_bar = self.resized(height, width)
        return (h_bar // self.patch_size) * (w_bar // self.patch_size) // (self.merge_size ** 2)


def _split(text: str, placeholder: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for index, segment in enumerate(text.split(placeholder)):
        if index:
            items.append({"type": "image"})
        if segment:
            items.append({"type": "text", "text": segment})
    return items


def placeholder_count(prompt: str | list[dict[str, Any]]) -> int:
    """How many `<image>` placeholders the prompt's text holds."""
    placeholder = MEDIA_KINDS["image"]
    if isinstance(prompt, str):
        return prompt.count(placeholder)
    return sum(m["content"].count(placeholder) for m in prompt if isinstance(m.get("content"), str))


def vision_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt as chat messages whose string contents are split at `<image>` into text and image items
    (messages whose content is already a list are kept, as slime does)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    for message in messages:
        if isinstance(message["content"], str):
            message["content"] = _split(message["content"], MEDIA_KINDS["image"])
    return messages


@dataclass(frozen=True)
class VisionTokenIds:
    vision_start: int
    vision_end: int
    image_pad: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "VisionTokenIds":
        ids = [tokenizer.convert_tokens_to_ids(token) for token in (VISION_START, VISION_END, IMAGE_PAD)]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise VisionPromptError(f"the tokenizer has no {VISION_START} / {VISION_END} / {IMAGE_PAD} tokens: "
                                    "image prompts need a Qwen-VL checkpoint")
        return cls(*ids)


def expand_image_pads(ids: list[int], counts: list[int], tokens: VisionTokenIds) -> list[int]:
    """Each `<|vision_start|> <|image_pad|>+ <|vision_end|>` run with the next image's count of pads (SGLang's Qwen-VL
    processor matches the same runs, so ids already expanded stay as they are)."""
    out: list[int] = []
    images = iter(counts)
    seen = 0
    i = 0
    while i < len(ids):
        out.append(ids[i])
        if ids[i] == tokens.vision_start and i + 1 < len(ids) and ids[i + 1] == tokens.image_pad:
            j = i + 1
            while j < len(ids) and ids[j] == tokens.image_pad:
                j += 1
            if j < len(ids) and ids[j] == tokens.vision_end:
                count = next(images, None)
                if count is None:
                    raise VisionPromptError(f"the prompt has more image slots than its {len(counts)} image(s)")
                seen += 1
                out.extend([tokens.image_pad] * count)
                i = j
                continue
        i += 1
    if seen != len(counts):
        raise VisionPromptError(f"the templated prompt has {seen} image slot(s) for {len(counts)} image(s): does the "
                                "chat template render image items?")
    return out



def image_processor(hf_checkpoint: str | Path) -> Any:  # -> Qwen2VLImageProcessorPil
    """The checkpoint's image processor: transformers' PIL Qwen2-VL one (what Qwen3-VL uses; the torchvision one does
    not import beside CPU torch) built from preprocessor_config.json. The CPU engine and the trainer both use it, so
    the pixels they see are the same. Imports transformers."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(hf_checkpoint) / "preprocessor_config.json"
    if not path.is_file():
        raise VisionPromptError(f"{path} does not exist: a vision model needs its image processor config")
    settings = {k: v for k, v in json.loads(path.read_text()).items()
                if k not in ("image_processor_type", "processor_class", "video_processor_type")}
    return Qwen2VLImageProcessorPil(**settings)


def processed_images(refs: list[str], processor: Any) -> dict[str, Any]:
    """`pixel_values` [patches, C*T*P*P] (float32) and `image_grid_thw` [images, 3] (int64) of these images, as numpy
    arrays: what the model's forward takes beside the prompt ids (whose pad runs `image_tokens` counted)."""
    import io

    from PIL import Image

    from hpc_rl.data.images import image_bytes

    images = []
    for ref in refs:
        with Image.open(io.BytesIO(image_bytes(ref))) as image:
            images.append(image.convert("RGB"))
    out = processor(images, return_tensors="np")
    return {"pixel_values": out["pixel_values"].astype("float32"), "image_grid_thw": out["image_grid_thw"].astype("int64")}


def with_processed_images(arrays: dict[str, Any], processor: Any) -> dict[str, Any]:
    """A train batch's arrays with the controller's `image_refs` (each sample's image references; the controller does
    not load torch, so it sends references) replaced by the processed images the trainer's `TrainBatch.from_arrays`
    reads: `image_counts` [samples], `image_grid_thw` [images, 3] and `pixel_values` [patches, C*T*P*P], samples in
    order. Arrays without `image_refs` are returned as they are. Runs on the trainer, with `image_processor`."""
    import numpy as np

    from hpc_rl.data.images import IMAGE_REFS_ARRAY, image_refs_from_array

    if IMAGE_REFS_ARRAY not in arrays:
        return arrays
    per_sample = image_refs_from_array(arrays[IMAGE_REFS_ARRAY])
    processed = [processed_images(refs, processor) for refs in per_sample if refs]
    out = {name: value for name, value in arrays.items() if name != IMAGE_REFS_ARRAY}
    out["image_counts"] = np.array([len(refs) for refs in per_sample], dtype=np.int32)
    out["image_grid_thw"] = (np.concatenate([p["image_grid_thw"] for p in processed]) if processed
                             else np.zeros((0, 3), dtype=np.int64))
    out["pixel_values"] = (np.concatenate([p["pixel_values"] for p in processed]) if processed
                           else np.zeros((0, 0), dtype=np.float32))
    return out
