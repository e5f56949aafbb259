"""Images in the CPU engine's `/generate` (SGLang's `image_data`), for Qwen-VL checkpoints served by transformers.

Owns: whether a loaded model sees images (its config has a `vision_config`), decoding one `image_data` item the
forms SGLang's `load_image` takes that a JSON body can carry (a `data:` URL, bare base64, a file path or `file://`
URL; http URLs are refused: engines need not reach the internet), the image processor (transformers' PIL
Qwen2-VL processor built from the checkpoint's preprocessor_config.json, the one Qwen3-VL uses; the torchvision one
does not import beside CPU torch, shared/notes/vlm-on-cpu.md), expanding each image's pad run of the prompt ids to
its token count (SGLang's Qwen-VL processor matches `<|vision_start|><|image_pad|>+<|vision_end|>` runs, so ids
sent already expanded stay as they are) and the per-request tensors the model's forward takes (`VisionInputs`).
The forward itself (M-RoPE positions, per-request caches) is `row_caches`'.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch

from hpc_rl.data.vision_prompts import VisionPromptError, VisionTokenIds, expand_image_pads, image_processor
from hpc_rl.engines.http_api import RequestError


def sees_images(model: torch.nn.Module) -> bool:
    """Whether the model has a vision tower (a transformers VL config)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


@dataclass
class VisionInputs:
    """What one request's prefill adds to its token ids: the processed images of its prompt."""

    pixel_values: torch.Tensor
    """[patches, channels * temporal_patch * patch * patch], every image of the prompt in order."""
    image_grid_thw: torch.Tensor
    """[images, 3] (t, h, w) patch grid of each image."""


def decode_item(item: Any) -> Any:  # -> PIL.Image.Image
    """One `image_data` item as an RGB PIL image; RequestError for what SGLang would not load either."""
    from PIL import Image

    if not isinstance(item, str) or not item:
        raise RequestError(f"image_data items must be strings (a data: URL, base64 or a file path), got "
                           f"{type(item).__name__}")
    if item.startswith(("http://", "https://")):
        raise RequestError("image_data: URLs are not fetched by the CPU engine; send base64 or a file path")
    try:
        if item.startswith("data:"):
            raw = base64.b64decode(item.split(",", 1)[1], validate=True)
        elif item.startswith("file://"):
            raw = Path(unquote(urlparse(item).path)).read_bytes()
        elif Path(item).is_file():
            raw = Path(item).read_bytes()
        else:
            raw = base64.b64decode(item, validate=True)
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except (OSError, ValueError, binascii.Error) as error:
        raise RequestError(f"image_data: cannot load an image ({type(error).__name__}: {error})") from None


class EngineImages:
    """The checkpoint's image processor and vision token ids, and preparing one request's images."""

    def __init__(self, model_path: str | Path, model_config: Any) -> None:
        self.processor = image_processor(model_path)  # VisionPromptError (a ValueError) without its config
        self.merge_size = int(self.processor.merge_size)
        self.tokens = VisionTokenIds(vision_start=int(model_config.vision_start_token_id),
                                     vision_end=int(model_config.vision_end_token_id),
                                     image_pad=int(model_config.image_token_id))

    def prepare(self, input_ids: list[int], items: list[Any]) -> tuple[list[int], VisionInputs]:
        """(ids with each image's pad run expanded, the processed images) of one request."""
        images = [decode_item(item) for item in items]
        processed = self.processor(images, return_tensors="pt")
        grid = processed["image_grid_thw"].to(torch.long)
        counts = [int(row.prod()) // self.merge_size ** 2 for row in grid]
        try:
            ids = expand_image_pads(input_ids, counts, self.tokens)
        except VisionPromptError as error:
            raise RequestError(f"image_data: {error}") from None
        return ids, VisionInputs(pixel_values=processed["pixel_values"], image_grid_thw=grid)


def request_items(value: Any) -> list[Any] | None:
    """One request's `image_data` as a list (SGLang: a single item or a list of items), None when absent."""
    if value is None or value == []:
        return None
    return list(value) if isinstance(value, list) else [value]
