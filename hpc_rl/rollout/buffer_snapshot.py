"""The partial-rollout buffer as it stood at a rollout boundary, taken as memory copies, not as JSON.

Owns `BufferSnapshot` (the buffer's groups as private copies of their samples, taken by `copy_sample`: per-token
columns copied as memory, `array[:]`, never turned into lists), its `state_dict()` (exactly
`PartialRolloutBuffer.state_dict()`'s JSON form, for checkpoints) and `json_state` (a scheduler snapshot in
`RolloutScheduler.state_dict()`'s form).

Why: the controller keeps the scheduler's state at each rollout boundary (`Rollouts._generate`: the state a rollout
starts from, which a checkpoint saved meanwhile stores, and the state it leaves, which the retained-rollouts journal
stores). As `state_dict()` every partial sample's tokens, log-probs and versions became Python lists (`to_dict`,
~0.2 ms per 2,500-token sample), then JSON text in the journal's thread (its digest and its record): at
bench_scale's N=256 in partial mode that was ~0.6 CPU-s of the loop and ~1 CPU-s of the journal threads per 4,096
samples. A copy is one memcpy per column: 23 us per 2,500-token sample against `state_dict()`'s 125
(tests/unit/test_buffer_snapshot.py prints both); the journal writes its columns raw and digests their bytes
(controller/retained_journal.py, controller/state_digest.py); only a checkpoint makes the JSON.

A copy is needed: the next rollout resumes the buffer's samples and appends to their columns while the snapshot
is still kept (a checkpoint of the state a rollout started from is saved after it ran). What is replaced and never
changed in place (numpy fields: routed experts, top-k log-probs; strings, numbers) is shared, not copied.
Does not own: what the buffer holds and when (partial_buffer.py, scheduler.py).
"""

from __future__ import annotations

import copy
from array import array
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.data.samples import Group, Sample

_SCALARS = (str, int, float, bool, type(None))
_LIST_FIELDS = ("prompt_token_ids", "images", "response_token_ids", "response_logprobs", "weight_versions",
                "loss_mask", "teacher_logprobs")
"""Sample fields that are flat lists of immutable items (a shallow copy copies them)."""
_NESTED_FIELDS = ("prompt", "label", "metadata")
"""Sample fields that may nest dicts and lists (copied as a tree)."""


def copy_sample(sample: Sample) -> Sample:
    """A copy that shares nothing changeable with `sample`: its compact columns copied as memory, its lists as
    lists (a C copy), its nested fields (metadata, chat prompt, label) as trees; any other attribute (slime's
    `remove_sample` mark) as it is."""
    fields = dict(sample.__dict__)
    columns = fields.get("_columns")
    if columns:
        fields["_columns"] = {name: values[:] for name, values in columns.items() if name not in fields}
    for name in _LIST_FIELDS:
        value = fields.get(name)
        if value is not None and name in fields:
            fields[name] = value[:] if isinstance(value, array) else list(value)
    for name in _NESTED_FIELDS:
        if name in fields:
            fields[name] = _tree_copy(fields[name])
    copied = object.__new__(type(sample))
    copied.__dict__.update(fields)
    return copied


def _tree_copy(value: Any) -> Any:
    """Dicts, lists and tuples copied all the way down; scalars shared; anything else deep-copied."""
    if isinstance(value, _SCALARS):
        return value
    if type(value) is dict:
        return {key: _tree_copy(item) for key, item in value.items()}
    if type(value) is list:
        return [_tree_copy(item) for item in value]
    if type(value) is tuple:
        return tuple(_tree_copy(item) for item in value)
    return copy.deepcopy(value)


@dataclass(eq=False)
class BufferSnapshot:
    """The partial buffer's groups at one moment, as copies (see the module docstring). Nobody changes them:
    a buffer restored from a snapshot takes copies of its samples again (`copy_groups`)."""

    groups: list[Group] = field(default_factory=list)
    version: int = 1
    """`PartialRolloutBuffer.state_dict()`'s version."""

    @classmethod
    def of(cls, groups: list[Group]) -> "BufferSnapshot":
        return cls(groups=[[copy_sample(s) for s in g] for g in groups])

    def copy_groups(self) -> list[Group]:
        return [[copy_sample(s) for s in g] for g in self.groups]

    @property
    def num_samples(self) -> int:
        return sum(len(g) for g in self.groups)

    def state_dict(self) -> dict[str, Any]:
        """`PartialRolloutBuffer.state_dict()`'s JSON form of these groups (a checkpoint's)."""
        return {"version": self.version, "groups": [[s.to_dict() for s in g] for g in self.groups]}

    def __eq__(self, other: object) -> bool:  # (tests: the same samples, every field, read without changing them)
        if not isinstance(other, BufferSnapshot):
            return NotImplemented
        return self.state_dict() == other.state_dict()


def json_state(state: dict[str, Any]) -> dict[str, Any]:
    """A scheduler state with its buffer as a `BufferSnapshot` (`RolloutScheduler.snapshot()`) in
    `state_dict()`'s JSON form; any other state as it is."""
    buffer = state.get("buffer")
    if isinstance(buffer, BufferSnapshot):
        return {**state, "buffer": buffer.state_dict()}
    return state
