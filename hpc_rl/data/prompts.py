"""Prompt datasets (JSONL / parquet) and the resumable, per-epoch-shuffled prompt source.

Owns: reading rows with line numbers (a malformed line is an error naming file:line, unless the
user opted in to skipping and gets a count), turning a row into a `PromptRecord`, the
(epoch, offset) cursor and its exact save/restore, and turning records into sample groups.
Tokenization (chat template) happens when a prompt is drawn, not at load, so loading stays fast.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from hpc_rl.data.samples import Group, Sample


class DataError(ValueError):
    """Bad prompt data; the message names the file and line (or row)."""


@dataclass(kw_only=True)
class PromptRecord:
    """One prompt row: its position in the file, the prompt, the label and metadata."""

    row: int
    """0-based row index in the dataset (stable id for resume and reports)."""
    prompt: str | list[dict[str, Any]]
    """A string or chat messages."""
    label: Any = None
    """Ground truth for the reward."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's metadata_key dict (plus `tools` when tool_key is set)."""
    images: list[str] = field(default_factory=list)
    """References of the row's images (`hpc_rl.data.images`), in placeholder order; empty without multimodal_keys."""


@dataclass(kw_only=True)
class DataKeys:
    """Which fields of a row hold what (rollout.input_key / label_key / metadata_key / tool_key)."""

    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = None
    tool_key: str | None = None
    multimodal_keys: dict[str, str] = field(default_factory=dict)
    """slime's --multimodal-keys: media kind (image) -> the column holding the row's items."""


def _check_prompt(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    ):
        return value
    raise DataError(f"{where}: {key!r} must be a string or a list of {{role, content}} messages, got {value!r:.80}")


def _row_images(row: dict[str, Any], prompt: str | list[dict[str, Any]], keys: DataKeys, where: str,
                data_file: str, position: int) -> list[str]:
    """The row's image references, checked against its `<image>` placeholders (slime's rule: one each)."""
    from hpc_rl.data.images import MEDIA_KINDS, ImageError, image_refs
    from hpc_rl.data.vision_prompts import placeholder_count

    refs: list[str] = []
    for kind, column in keys.multimodal_keys.items():
        if kind not in MEDIA_KINDS:
            raise DataError(f"multimodal_keys: media kind {kind!r} is not served (only {', '.join(MEDIA_KINDS)})")
        try:
            refs += image_refs(row.get(column), data_file=data_file, position=position, column=column, where=where)
        except ImageError as error:
            raise DataError(str(error)) from None
    slots = placeholder_count(prompt)
    if slots != len(refs):
        raise DataError(f"{where}: the prompt has {slots} '<image>' placeholder(s) but the row has {len(refs)} "
                        f"image(s) in {', '.join(map(repr, keys.multimodal_keys.values()))}; one image per placeholder")
    return refs


def row_to_record(row: Any, index: int, keys: DataKeys, where: str, *, data_file: str = "",
                  position: int = 0) -> PromptRecord:
    """Validate one parsed row; raise DataError naming `where` and the missing field. `data_file` and `position`
    (the row's byte offset in a jsonl file, its row number in a parquet file) locate inline images."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if keys.input_key not in row:
        raise DataError(f"{where}: missing input key {keys.input_key!r} (fields: {', '.join(sorted(row))}); "
                        f"set rollout.input_key")
    prompt = _check_prompt(row[keys.input_key], where, keys.input_key)
    if keys.label_key is not None and keys.label_key not in row:
        raise DataError(f"{where}: missing label key {keys.label_key!r} (fields: {', '.join(sorted(row))}); "
                        f"set rollout.label_key (or null)")
    metadata: dict[str, Any] = {}
    if keys.metadata_key is not None:
        raw = row.get(keys.metadata_key) or {}
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: {keys.metadata_key!r} is not a JSON object: {error}") from None
        if not isinstance(raw, dict):
            raise DataError(f"{where}: {keys.metadata_key!r} must be an object")
        metadata = dict(raw)
    if keys.tool_key is not None and row.get(keys.tool_key) is not None:
        metadata["tools"] = row[keys.tool_key]
    label = row.get(keys.label_key) if keys.label_key is not None else None
    images = _row_images(row, prompt, keys, where, data_file, position) if keys.multimodal_keys else []
    return PromptRecord(row=index, prompt=prompt, label=label, metadata=metadata, images=images)


def _iter_jsonl(path: Path) -> Iterator[tuple[str, int, Any | DataError]]:
    """Lines are decoded one by one: a line that is not UTF-8 is a DataError naming it (skippable with
    skip_bad_lines), not a UnicodeDecodeError that ends the read with no line number."""
    offset = 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where, position = f"{path}:{line_number}", offset
            offset += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield where, position, DataError(f"{where}: not UTF-8 (byte 0x{raw[error.start]:02x} at column "
                                                 f"{error.start + 1}); re-encode the file as UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield where, position, json.loads(line)
            except json.JSONDecodeError as error:
                yield where, position, DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})")


def _iter_parquet(path: Path) -> Iterator[tuple[str, int, Any]]:
    import pyarrow.parquet as pq

    row_number = 0
    handle = pq.ParquetFile(path)
    for group in range(handle.num_row_groups):  # one row group in memory at a time (image bytes can be large)
        for row in handle.read_row_group(group).to_pylist():
            yield f"{path}: row {row_number}", row_number, row
            row_number += 1


def iter_rows_at(path: str | Path) -> Iterator[tuple[str, int, Any]]:
    """(where, position, parsed row or DataError) for each non-empty row of a .jsonl or .parquet file; position is
    the line's byte offset (jsonl) or the row number (parquet), where `hpc_rl.data.images` reads it back."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: prompt data file not found")
    if path.suffix == ".parquet":
        return _iter_parquet(path)
    return _iter_jsonl(path)


def iter_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed row or DataError) for each non-empty row of a .jsonl or .parquet file."""
    return ((where, row) for where, _, row in iter_rows_at(path))


@dataclass
class PromptDataset:
    """All rows of one prompt file, validated at load."""

    path: str
    records: list[PromptRecord]
    skipped: list[str] = field(default_factory=list)
    """Why each skipped line was skipped ("file:line: reason"), in file order (skip_bad_lines)."""

    @property
    def skipped_lines(self) -> int:
        return len(self.skipped)

    def describe_skipped(self, shown: int = 20) -> str:
        """The skipped lines, one per line (the first `shown`, then how many more)."""
        lines = self.skipped[:shown]
        if len(self.skipped) > shown:
            lines.append(f"... and {len(self.skipped) - shown} more")
        return "\n".join(f"  {line}" for line in lines)

    @classmethod
    def load(cls, path: str | Path, keys: DataKeys, *, skip_bad_lines: bool = False,
             limit: int | None = None) -> "PromptDataset":
        records: list[PromptRecord] = []
        skipped: list[str] = []
        data_file = str(Path(path).resolve())
        for where, position, row in iter_rows_at(path):
            try:
                if isinstance(row, DataError):
                    raise row
                records.append(row_to_record(row, len(records), keys, where, data_file=data_file,
                                             position=position))
            except DataError as error:
                if not skip_bad_lines:
                    raise DataError(f"{error} (set rollout.skip_bad_lines to skip bad lines)") from None
                skipped.append(str(error))
            if limit is not None and len(records) >= limit:
                break
        if not records:
            raise DataError(f"{path}: no usable rows")
        return cls(path=str(path), records=records, skipped=skipped)

    def __len__(self) -> int:
        return len(self.records)


class PromptSource:
    """Draws prompts epoch by epoch, shuffled per epoch with (seed, epoch); the cursor resumes exactly."""

    def __init__(self, dataset: PromptDataset, *, shuffle: bool, seed: int) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_records(self, count: int) -> list[PromptRecord]:
        """The next `count` prompts, crossing epoch boundaries as needed."""
        drawn: list[PromptRecord] = []
        while len(drawn) < count:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._order_for(self.epoch)
            take = min(count - len(drawn), len(self._order) - self.offset)
            drawn.extend(self.dataset.records[i] for i in self._order[self.offset:self.offset + take])
            self.offset += take
        return drawn

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_rows"] != len(self.dataset):
            raise DataError(
                f"{self.dataset.path}: the checkpoint's data cursor is for {state['num_rows']} rows but the file "
                f"has {len(self.dataset)}; resume with the same prompt data"
            )
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._order_for(self.epoch)


PromptEncoder = Callable[..., list[int]]
"""(prompt, metadata[, image references]) -> prompt token ids (chat template applied or not; image pads expanded)."""


def make_prompt_encoder(tokenizer: Any, *, apply_chat_template: bool,
                        chat_template_kwargs: dict[str, Any] | None = None,
                        image_grid: Any = None) -> PromptEncoder:
    """How prompts become token ids: the tokenizer's chat template (add_generation_prompt; with
    `chat_template_kwargs` as extra template variables, slime's --apply-chat-template-kwargs) or plain encode.
    With `image_grid` (`vision_prompts.ImageGrid`, multimodal_keys), a prompt with images is split at its `<image>`
    placeholders into image items, templated, and each image's pad run expanded to its token count."""
    extra = dict(chat_template_kwargs or {})
    vision_tokens = None
    if image_grid is not None:
        from hpc_rl.data.vision_prompts import VisionTokenIds

        vision_tokens = VisionTokenIds.from_tokenizer(tokenizer)

    def encode(prompt: str | list[dict[str, Any]], metadata: dict[str, Any], images: list[str] | tuple = ()) -> list[int]:
        if images:
            return _encode_with_images(prompt, metadata, list(images))
        if apply_chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(
                messages, tools=metadata.get("tools"), tokenize=False, add_generation_prompt=True, **extra
            )
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, list):
            text = "\n".join(str(m["content"]) for m in prompt)
        else:
            text = prompt
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode_with_images(prompt: str | list[dict[str, Any]], metadata: dict[str, Any],
                            images: list[str]) -> list[int]:
        from hpc_rl.data.images import image_bytes, image_size
        from hpc_rl.data.vision_prompts import expand_image_pads, vision_messages

        if image_grid is None or vision_tokens is None:
            raise DataError("a prompt with images needs rollout.multimodal_keys and a Qwen-VL checkpoint")
        text = tokenizer.apply_chat_template(vision_messages(prompt), tools=metadata.get("tools"), tokenize=False,
                                             add_generation_prompt=True, **extra)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        counts = [image_grid.image_tokens(*image_size(image_bytes(ref))) for ref in images]
        return expand_image_pads(ids, counts, vision_tokens)

    return encode


def encode_record(encoder: PromptEncoder, record: PromptRecord) -> list[int]:
    """A record's prompt ids (its images passed only when it has some: text encoders take two arguments)."""
    if record.images:
        return encoder(record.prompt, record.metadata, record.images)
    return encoder(record.prompt, record.metadata)


def make_group(record: PromptRecord, *, group_index: int, first_sample_index: int, n_samples: int,
               prompt_token_ids: list[int]) -> Group:
    """`n_samples` fresh samples of one prompt."""
    return [
        Sample(
            index=first_sample_index + k,
            group_index=group_index,
            prompt=record.prompt,
            prompt_token_ids=list(prompt_token_ids),
            label=record.label,
            metadata={**record.metadata, "data_row": record.row},
            images=list(record.images),
        )
        for k in range(n_samples)
    ]
