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


@dataclass(kw_only=True)
class DataKeys:
    """Which fields of a row hold what (rollout.input_key / label_key / metadata_key / tool_key)."""

    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = None
    tool_key: str | None = None


def _check_prompt(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    ):
        return value
    raise DataError(f"{where}: {key!r} must be a string or a list of {{role, content}} messages, got {value!r:.80}")


def row_to_record(row: Any, index: int, keys: DataKeys, where: str) -> PromptRecord:
    """Validate one parsed row; raise DataError naming `where` and the missing field."""
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
    return PromptRecord(row=index, prompt=prompt, label=label, metadata=metadata)


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any | DataError]]:
    """Lines are decoded one by one: a line that is not UTF-8 is a DataError naming it (skippable with
    skip_bad_lines), not a UnicodeDecodeError that ends the read with no line number."""
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield where, DataError(f"{where}: not UTF-8 (byte 0x{raw[error.start]:02x} at column "
                                       f"{error.start + 1}); re-encode the file as UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                yield where, DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})")


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    for row_number, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path}: row {row_number}", row


def iter_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed row or DataError) for each non-empty row of a .jsonl or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: prompt data file not found")
    if path.suffix == ".parquet":
        return _iter_parquet(path)
    return _iter_jsonl(path)


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
        for where, row in iter_rows(path):
            try:
                if isinstance(row, DataError):
                    raise row
                records.append(row_to_record(row, len(records), keys, where))
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


PromptEncoder = Callable[[str | list[dict[str, Any]], dict[str, Any]], list[int]]
"""(prompt, metadata) -> prompt token ids (chat template applied or not)."""


def make_prompt_encoder(tokenizer: Any, *, apply_chat_template: bool,
                        chat_template_kwargs: dict[str, Any] | None = None) -> PromptEncoder:
    """How prompts become token ids: the tokenizer's chat template (add_generation_prompt; with
    `chat_template_kwargs` as extra template variables, slime's --apply-chat-template-kwargs) or plain encode."""
    extra = dict(chat_template_kwargs or {})

    def encode(prompt: str | list[dict[str, Any]], metadata: dict[str, Any]) -> list[int]:
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

    return encode


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
        )
        for k in range(n_samples)
    ]
