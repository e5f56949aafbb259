"""Prompt images (slime's `--multimodal-keys`): where each one is, reading it back lazily, and checking it at submit.

Owns: turning one data row's media column into image references (`ImageRef`, a short string a `Sample` carries and
a checkpoint keeps), reading an image's bytes from its reference when a request needs them, the data URL an engine's
`/generate` takes (`image_data`), and the submit-time check of one image (missing, undecodable, oversized: the
message names the file and the row). No image is kept in memory: a reference is a file path, or the data file,
the row's position in it and the item's place, re-read when drawn.

An item, as slime reads it (slime/utils/data.py `_build_messages`, processing_utils): a path (relative to the data
file; `file://` too), a base64 string or `data:` URL, raw bytes (parquet binary), or a dict: HF datasets' image
feature `{"bytes", "path"}` or Qwen's rich form `{"type": "image", "image": ...}`. URLs are refused (compute nodes
need not reach the internet); per-image `min_pixels`/`max_pixels` are refused (the checkpoint's image processor
config sets the size, and the controller's token count must agree with it).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INLINE_PREFIX = "inline:"
"""An inline image's reference: `inline:<position>:<item>:<column>@<data file>`."""
MEDIA_KINDS = {"image": "<image>"}
"""slime's MultimodalTypes that hpc_rl serves: kind -> its placeholder in the prompt (video and audio: refused)."""
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")
_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"RIFF", "webp"), (b"BM", "bmp"))


class ImageError(ValueError):
    """A prompt image that cannot be used; the message names the data file's row and the image."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may be (rollout.max_image_bytes / max_image_pixels)."""

    max_bytes: int
    max_pixels: int


def _looks_base64(text: str) -> bool:
    if len(text) < 16 or any(c.isspace() for c in text[:64]):
        return False
    try:
        base64.b64decode(text[:64 - 64 % 4] or text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def image_refs(items: Any, *, data_file: str, position: int, column: str, where: str) -> list[str]:
    """The references of one row's media column (a list of items, or one item)."""
    if items is None:
        return []
    if hasattr(items, "tolist") and not isinstance(items, (bytes, str)):
        items = items.tolist()
    if not isinstance(items, list):
        items = [items]
    return [_item_ref(item, index, data_file=data_file, position=position, column=column, where=where)
            for index, item in enumerate(items)]


def _item_ref(item: Any, index: int, *, data_file: str, position: int, column: str, where: str) -> str:
    inline = f"{INLINE_PREFIX}{position}:{index}:{column}@{data_file}"
    label = f"{where}: {column}[{index}]"
    if isinstance(item, dict):
        for option in ("min_pixels", "max_pixels", "resized_height", "resized_width"):
            if option in item:
                raise ImageError(f"{label}: per-image {option!r} is not offered (the checkpoint's "
                                 "preprocessor_config.json sets the size); drop it")
        if item.get("bytes") is not None:
            return inline
        value = item.get("image", item.get("path"))
        if value is None:
            raise ImageError(f"{label}: an image dict needs 'image', 'bytes' or 'path', got keys {sorted(item)}")
        return _item_ref(value, index, data_file=data_file, position=position, column=column, where=where)
    if isinstance(item, (bytes, bytearray)):
        return inline
    if not isinstance(item, str) or not item:
        raise ImageError(f"{label}: an image must be a path, base64 text, bytes or a dict, got {item!r:.60}")
    if item.startswith(("http://", "https://")):
        raise ImageError(f"{label}: image URLs are not fetched ({item:.80}); download the images and give paths")
    if item.startswith("data:"):
        return inline
    path_text = item[len("file://"):] if item.startswith("file://") else item
    path = Path(path_text) if Path(path_text).is_absolute() else Path(data_file).resolve().parent / path_text
    if path.is_file() or path_text.lower().endswith(_IMAGE_SUFFIXES) or not _looks_base64(item):
        return str(path)
    return inline


def _decode_inline_value(value: Any, ref: str) -> bytes:
    if isinstance(value, dict):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("image")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        encoded = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            return base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ImageError(f"{ref}: not valid base64 ({error})") from None
    raise ImageError(f"{ref}: cannot read an image from {type(value).__name__}")


def _inline_row(data_file: str, position: int) -> dict[str, Any]:
    if data_file.endswith(".parquet"):
        import pyarrow.parquet as pq

        handle = pq.ParquetFile(data_file)
        start = 0
        for group in range(handle.num_row_groups):
            rows = handle.metadata.row_group(group).num_rows
            if position < start + rows:
                return handle.read_row_group(group).slice(position - start, 1).to_pylist()[0]
            start += rows
        raise ImageError(f"{data_file}: row {position} is past the end of the file")
    with open(data_file, "rb") as handle:
        handle.seek(position)
        return json.loads(handle.readline())


def image_bytes(ref: str) -> bytes:
    """The encoded image (PNG, JPEG, ...) a reference points at, read now."""
    if not ref.startswith(INLINE_PREFIX):
        return Path(ref).read_bytes()
    place, data_file = ref[len(INLINE_PREFIX):].split("@", 1)
    position, index, column = place.split(":", 2)
    value = _inline_row(data_file, int(position))[column]
    items = value if isinstance(value, list) else [value]
    return _decode_inline_value(items[int(index)], describe(ref))


def describe(ref: str) -> str:
    """A reference as a person reads it: the path, or the data file, row position, column and item."""
    if not ref.startswith(INLINE_PREFIX):
        return ref
    place, data_file = ref[len(INLINE_PREFIX):].split("@", 1)
    position, index, column = place.split(":", 2)
    unit = "row" if data_file.endswith(".parquet") else "byte offset"
    return f"{data_file} ({unit} {position}) {column}[{index}] (inline)"


def image_data_url(ref: str) -> str:
    """The image as a base64 `data:` URL: one of the forms SGLang's `image_data` takes (its load_image)."""
    raw = image_bytes(ref)
    kind = next((name for magic, name in _MAGIC if raw.startswith(magic)), "png")
    return f"data:image/{kind};base64,{base64.b64encode(raw).decode('ascii')}"


def image_size(raw: bytes) -> tuple[int, int]:
    """(width, height) from the image's header (no full decode)."""
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as image:
        return image.size


def image_problem(ref: str, limits: ImageLimits) -> str | None:
    """Why an image cannot be used (missing, too many bytes, not decodable, too many pixels), or None."""
    from PIL import Image

    try:
        raw = image_bytes(ref)
    except FileNotFoundError:
        return f"image file {ref} does not exist"
    except (OSError, KeyError, IndexError, ValueError, ImageError) as error:
        return f"image {describe(ref)} cannot be read: {error}"
    if len(raw) > limits.max_bytes:
        return (f"image {describe(ref)} is {len(raw)} bytes, over rollout.max_image_bytes={limits.max_bytes}; "
                "shrink it or raise the limit")
    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            if width * height > limits.max_pixels:
                return (f"image {describe(ref)} is {width}x{height} pixels, over rollout.max_image_pixels="
                        f"{limits.max_pixels}; shrink it or raise the limit")
            image.load()
    except Image.DecompressionBombError as error:
        return f"image {describe(ref)} is oversized ({error}); shrink it"
    except Exception as error:  # noqa: BLE001 - PIL raises many types on a corrupt file
        return f"image {describe(ref)} cannot be decoded ({type(error).__name__}: {error})"
    return None


IMAGE_REFS_ARRAY = "image_refs"
"""The train-batch array holding every sample's image references (UTF-8 JSON `[[ref, ...], ...]` as uint8)."""


def image_refs_array(per_sample: list[list[str]]) -> Any:  # -> np.ndarray
    """Each sample's image references as one uint8 array for the controller's wire (JSON text, no pickle)."""
    import numpy as np

    return np.frombuffer(json.dumps(per_sample).encode("utf-8"), dtype=np.uint8)


def image_refs_from_array(array: Any) -> list[list[str]]:
    """The inverse of `image_refs_array`."""
    return [list(refs) for refs in json.loads(bytes(array).decode("utf-8"))]
