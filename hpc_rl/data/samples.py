"""The `Sample` a rollout produces and the group type (one prompt, `n_samples_per_prompt` samples).

Owns: the fields every stage reads or writes (data source -> generation -> reward -> filter ->
buffer -> trainer), their status, and a JSON-safe dict form for checkpoints and the wire. Kept small
on purpose: anything task-specific goes into `metadata`.

Per-token columns. A full-length response is thousands of tokens, and the controller handles every sample of
every engine: as Python lists its tokens, log-probs and versions cost a list item each to build from the
engine's answer and again to pack for the trainer (~200 us per sample, most of the coordinating process's
per-token work in benchmarks/bench_scale.py). So generation appends them to compact arrays
(`array('q')` tokens and versions, `array('d')` log-probs: the same values; tokens and log-probs also in their
narrow forms, `array('i')` / `array('f')`, when those hold the same numbers exactly: data/column_forms.py, what
the answer workers send) held beside the fields
(`extend_response`), and the controller's own readers take them as they are (`column`, `response_length`,
the trainer's packing). The fields stay lists for everyone else: the first read of `response_token_ids`,
`response_logprobs` or `weight_versions` turns that column into the list it stands for (once; later reads
and writes are the list's; an assigned list replaces the column), so plug-ins, checkpoints and equality see
exactly what they saw before. The weight versions are one version throughout in the common case (an answer from one
policy): an answer's reader may hand them over as a `UniformColumn` (data/uniform_column.py: (version, length), read
like the `array('q')` it stands for), which the sample holds until a second version appears (then an `array('q')`),
so that no per-token version array is made, copied or scanned (`uniform_weight_version`). A column keeps its form
while what is appended fits it exactly (a narrow column is widened first when a later turn appends numbers that do
not); readers of raw memory take the typecode from the array (`COLUMN_FORMS`).
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from hpc_rl.data.column_forms import COLUMN_FORMS, narrowed, widened
from hpc_rl.data.routed_experts import routing_from_json, routing_to_json
from hpc_rl.data.uniform_column import UniformColumn


COLUMN_TYPECODES = {"response_token_ids": "q", "response_logprobs": "d", "weight_versions": "q"}
"""The per-token fields a sample may hold as compact arrays, and each array's wide type (int64, float64, int64); the
token ids and log-probs may also be held narrow (int32, float32: `COLUMN_FORMS`)."""


class SampleStatus(str, enum.Enum):
    """Where a sample is in its life."""

    PENDING = "pending"
    """Not generated yet, or generation not finished (a partial sample in the buffer)."""
    COMPLETED = "completed"
    """Generation stopped on a stop token / EOS."""
    TRUNCATED = "truncated"
    """Generation hit the response length limit."""
    ABORTED = "aborted"
    """Generation was cut short by an abort (engine paused, surplus request, engine lost)."""
    FAILED = "failed"
    """The engine or a custom generate function reported an error."""


@dataclass(kw_only=True)
class Sample:
    """One response to one prompt, with everything the trainer and the buffer need."""

    index: int
    """Unique id of this sample within the run (stable across retries and resume)."""
    group_index: int
    """Id of the prompt group (all samples of one prompt share it)."""
    prompt: str | list[dict[str, Any]]
    """The prompt as read from the data (a string or chat messages)."""
    prompt_token_ids: list[int]
    """Prompt tokens sent to the engine (chat template applied)."""
    label: Any = None
    """Ground truth for the reward (the data's `label_key`)."""
    images: list[str] = field(default_factory=list)
    """The prompt's images as references (`hpc_rl.data.images`: a path, or an inline item of the data file), in
    prompt order; sent with every request (a resumed partial sample too) as `image_data`."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form per-sample data (the data's `metadata_key`, `start_rollout_id`, tool state...)."""
    response_token_ids: list[int] = field(default_factory=list)
    """Generated tokens so far (for multi-turn: including tool-result tokens, see `loss_mask`)."""
    response_logprobs: list[float] = field(default_factory=list)
    """Log-probability of each response token under the engine's policy (0.0 for tool tokens)."""
    weight_versions: list[int] = field(default_factory=list)
    """Per response token: the weight version of the policy that generated it."""
    loss_mask: list[int] | None = None
    """Per response token 1 = trained, 0 = masked (tool output, off-policy); None = all ones."""
    response_text: str = ""
    """Decoded response (what rewards read)."""
    status: SampleStatus = SampleStatus.PENDING
    """Generation status."""
    reward: float | None = None
    """Scalar reward once scored."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation with a teacher server: the teacher's log-prob of each response token."""
    rid: str = ""
    """Request id of the last engine request for this sample (for aborts)."""
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    """[positions, num_layers, topk] experts the engine routed each token to, prompt and response but
    the last token (`hpc_rl.data.routed_experts`); only with `training.use_rollout_routing_replay`."""

    top_logprob_ids: np.ndarray | None = field(default=None, compare=False)
    """[response tokens, k] int32: per generated token, the engine's k most likely token ids at that position
    (SGLang's meta_info.output_top_logprobs); only with `algorithm.use_score_centering`."""
    top_logprobs: np.ndarray | None = field(default=None, compare=False)
    """[response tokens, k] float32: the engine's log-probs of `top_logprob_ids` (tool tokens: -inf, untrained)."""

    # -- per-token columns (module docstring) -------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Only reached for a field held as a compact column (normal lookup found no list): make it the list."""
        columns = self.__dict__.get("_columns")
        if columns is not None and name in columns:  # (an assigned field is in __dict__: never here)
            value = columns.pop(name).tolist()
            self.__dict__[name] = value
            return value
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def column(self, name: str) -> Sequence[Any]:
        """A per-token field as it is held (a compact array or the list), for reading without making a list;
        callers must not change it. A field assigned or read as a list is the list (an old column is stale)."""
        fields = self.__dict__
        return fields[name] if name in fields else fields["_columns"][name]

    def extend_response(self, token_ids: Iterable[int], logprobs: Iterable[float], versions: Iterable[int], *,
                        adopt: bool = False) -> None:
        """Append generated tokens, their log-probs and weight versions (arrays or lists of numbers; the versions
        also a `UniformColumn`). A sample whose three fields are empty (all lists, or all columns) starts holding
        them as compact columns; a `UniformColumn` of versions is held as it is (immutable: never copied) and
        grows as one while the versions appended are `UniformColumn`s of its version.

        `adopt`: the caller hands the three over (arrays made for this call and used by no one after it, e.g.
        those generate.py reads from an answer worker's frame): an empty sample then holds them as its columns
        instead of copying them (the second copy of every answer). Values
        that are not three distinct arrays of the columns' types are copied as without `adopt`."""
        fields = self.__dict__
        given = (token_ids, logprobs, versions)
        listed = (_TOKENS in fields) + (_LOGPROBS in fields) + (_VERSIONS in fields)
        if listed == 3:
            fresh = not (fields[_TOKENS] or fields[_LOGPROBS] or fields[_VERSIONS])
            columns = None
        else:
            fresh = False
            columns = fields["_columns"]
        if adopt and (fresh or listed == 0 and not (len(columns[_TOKENS]) or len(columns[_LOGPROBS])
                                                    or len(columns[_VERSIONS]))) and _adoptable(given):
            if listed:
                del fields[_TOKENS], fields[_LOGPROBS], fields[_VERSIONS]
            fields["_columns"] = dict(zip(COLUMN_TYPECODES, given))
            return
        if fresh:
            del fields[_TOKENS], fields[_LOGPROBS], fields[_VERSIONS]
            columns = fields["_columns"] = {name: array(code) for name, code in COLUMN_TYPECODES.items()}
        for name, values in zip(COLUMN_TYPECODES, given):
            if name in fields:  # held as a list
                fields[name].extend(values.tolist() if isinstance(values, UniformColumn) else values)
            else:
                columns[name] = _extended(columns[name], values)

    def uniform_weight_version(self) -> int | None:
        """The one weight version of all of the response's tokens when the sample holds its versions as a non-empty
        `UniformColumn` (O(1): no token is read; the length is `len(self.column("weight_versions"))`); None when
        they are held otherwise (a list or an array, even of one version) or there are none."""
        if "weight_versions" in self.__dict__:
            return None
        held = self.__dict__["_columns"]["weight_versions"]
        return held.value if isinstance(held, UniformColumn) and held.length else None

    def compact_columns(self, *, expand_uniform: bool = True) -> dict[str, array]:
        """The per-token fields still held as compact arrays, name -> array (not copied: callers must not change
        them); a field assigned or read as a list is not among them. For writers of raw bytes (the
        retained-rollouts journal) that must not turn a column into a list. Versions held as a `UniformColumn` are
        given as a new `array('q')` of its elements, or with `expand_uniform=False` as the `UniformColumn` itself
        (`uniform_weight_version`). Tokens and log-probs may be narrow (`COLUMN_FORMS`): read the typecode."""
        columns = self.__dict__.get("_columns")
        if not columns:
            return {}
        held = {name: values for name, values in columns.items() if name not in self.__dict__}
        versions = held.get(_VERSIONS)
        if expand_uniform and isinstance(versions, UniformColumn):
            held[_VERSIONS] = versions.expanded()
        return held

    def hold_columns(self, columns: dict[str, array]) -> None:
        """Hold these per-token fields as the given compact arrays (what `extend_response` builds; each of
        `COLUMN_FORMS`' types, the versions also a `UniformColumn`), replacing their values: for readers of a
        stored sample."""
        for name, values in columns.items():
            if getattr(values, "typecode", None) not in COLUMN_FORMS.get(name, ()) or (
                    isinstance(values, UniformColumn) and name != _VERSIONS):
                raise ValueError(f"{name}: a compact column is an array of typecode "
                                 f"{' or '.join(map(repr, COLUMN_FORMS.get(name, ('?',))))}, got "
                                 f"{type(values).__name__}({getattr(values, 'typecode', '')!r})")
        fields = self.__dict__
        held = fields.setdefault("_columns", {})
        for name, values in columns.items():
            fields.pop(name, None)
            held[name] = values

    @property
    def response_length(self) -> int:
        return len(self.column("response_token_ids"))

    @property
    def total_length(self) -> int:
        return len(self.prompt_token_ids) + self.response_length

    def effective_loss_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask is not None else [1] * self.response_length

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (checkpoints, status files, the partial buffer's state). The per-token fields are copied
        as lists (`list`, `array.tolist`: one C pass) and a compact column is not made the field's list:
        `dataclasses.asdict` deep-copied every token list item by item (4.6 ms for a sample of 3,000 tokens; the
        scheduler's state holds every partial sample's, snapshotted at each rollout's start and end)."""
        data = asdict(replace(self, **dict.fromkeys(_TOKEN_LISTS)))  # (replace reads only the other fields)
        for name in _TOKEN_LISTS:
            values = self.column(name) if name in COLUMN_TYPECODES else getattr(self, name)
            data[name] = (None if values is None else values.tolist()
                          if isinstance(values, (array, np.ndarray, UniformColumn))
                          else list(values))
        data["status"] = self.status.value
        if self.routed_experts is not None:
            data["routed_experts"] = routing_to_json(self.routed_experts)
        if self.top_logprob_ids is not None and self.top_logprobs is not None:
            data["top_logprob_ids"] = self.top_logprob_ids.tolist()
            data["top_logprobs"] = [[v if np.isfinite(v) else None for v in row] for row in self.top_logprobs.tolist()]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        data = dict(data)
        data["status"] = SampleStatus(data.get("status", SampleStatus.PENDING.value))
        if data.get("routed_experts") is not None:
            data["routed_experts"] = routing_from_json(data["routed_experts"])
        if data.get("top_logprob_ids") is not None and data.get("top_logprobs") is not None:
            data["top_logprob_ids"] = np.asarray(data["top_logprob_ids"], dtype=np.int32)
            data["top_logprobs"] = np.asarray(
                [[-np.inf if v is None else v for v in row] for row in data["top_logprobs"]], dtype=np.float32)
        return cls(**data)


_TOKENS, _LOGPROBS, _VERSIONS = COLUMN_TYPECODES


def _adoptable(values: tuple[Any, ...]) -> bool:
    """Three distinct arrays of the compact columns' types (`COLUMN_FORMS`), in `COLUMN_TYPECODES`' order (the
    versions also a `UniformColumn`: immutable, so held as it is)."""
    tokens, logprobs, versions = values
    return (isinstance(tokens, array) and tokens.typecode in _TOKEN_FORMS and isinstance(logprobs, array)
            and logprobs.typecode in _LOGPROB_FORMS
            and (isinstance(versions, UniformColumn) or isinstance(versions, array)
                 and versions.typecode == "q" and versions is not tokens))


_TOKEN_FORMS, _LOGPROB_FORMS = COLUMN_FORMS[_TOKENS], COLUMN_FORMS[_LOGPROBS]


def _extended(held: array | UniformColumn, values: Iterable[Any]) -> array | UniformColumn:
    """A compact column with `values` appended: the same array (extended in place), or a `UniformColumn` while
    both are one version, else an array of both. A narrow column (`COLUMN_FORMS`) stays narrow while the values fit
    it exactly, else it is widened first; an empty column takes the form of an array appended to it."""
    if isinstance(values, UniformColumn):
        if not len(held):
            return values
        if isinstance(held, UniformColumn) and (held.value == values.value or not values.length):
            return UniformColumn(held.value, held.length + values.length)
        values = values.expanded()
    if isinstance(held, UniformColumn):
        held = held.expanded()
    if isinstance(values, array) and values.typecode == held.typecode:
        held.extend(values)
        return held
    if held.typecode == "q" or held.typecode == "d":  # wide: any numbers (a narrow array's as the wide type)
        if isinstance(values, array) and values.typecode != held.typecode:
            if not len(held) and _WIDE_OF.get(values.typecode) == held.typecode:  # empty: take the narrow form
                held = array(values.typecode)
                held.extend(values)
                return held
            values = widened(values)
            if values.typecode != held.typecode:
                raise TypeError(f"cannot append an array({values.typecode!r}) to a column of array({held.typecode!r})")
        held.extend(values)
        return held
    # narrow: the values as the wide type, narrowed when exact, else the column widened
    wide = widened(values) if isinstance(values, array) else array(_WIDE_OF[held.typecode], values)
    narrow = narrowed(wide)
    if narrow.typecode == held.typecode:
        held.extend(narrow)
        return held
    held = widened(held)
    held.extend(wide)
    return held


_WIDE_OF = {"i": "q", "f": "d"}


_TOKEN_LISTS = ("prompt_token_ids", "response_token_ids", "response_logprobs", "weight_versions", "loss_mask",
                "teacher_logprobs")
"""Sample's fields that are lists of numbers (copied as such by `to_dict`)."""

Group = list[Sample]
"""All samples of one prompt (slime's filters and buffer filters take `list[Sample]`)."""
