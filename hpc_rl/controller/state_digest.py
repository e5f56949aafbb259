"""A scheduler state's identity: the digest that ties a retained rollout to the state it started from.

Owns `state_digest` and its kinds. A digest is the same for a state in memory (`RolloutScheduler.snapshot()`, its
partial buffer as a `BufferSnapshot`), its JSON form (`state_dict()`), the form a checkpoint gives back (the
protocol's JSON: keys as strings, tuples as lists) and the form the journal gives back; another data cursor,
counter or buffered token gives another. The weight version (the one the engines serve) is set apart.

Kinds (a record says which its `state_before` is; controller/retained_journal.py):
  - "raw" (records since Nov 29 2026, evening): sha256 over the state's JSON less its buffer (orjson, keys sorted),
    then per buffered sample its fields less the per-token columns (orjson, keys sorted) and the columns' numbers as
    int64 / float64 bytes (a non-finite log-prob as one NaN: orjson, which earlier records used, wrote them null).
    Why: "orjson" wrote every buffered token as JSON text, 110 us per buffered 2,500-token sample of the journal
    thread's time, after the loop had made them lists (`state_dict()`, 125 us); "raw" hashes the bytes straight from
    the samples' compact columns (sha256 at ~1.4 GB/s here): 32 us (tests/unit/test_buffer_snapshot.py prints both).
  - "orjson" (FORMAT-2 records before): sha256 of orjson's JSON of the whole state, keys sorted.
  - "json" (FORMAT-1 records): the json module's digest of a JSON round trip.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import fields
from typing import Any

import numpy as np
import orjson

from hpc_rl.data.column_forms import COLUMN_FORMS, DTYPES
from hpc_rl.data.samples import COLUMN_TYPECODES, Sample
from hpc_rl.rollout.buffer_snapshot import BufferSnapshot, json_state

DIGEST = "raw"
"""The kind new records carry."""
KINDS = ("raw", "orjson", "json")

_ORJSON = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
_NUMPY_FIELDS = ("routed_experts", "top_logprob_ids", "top_logprobs")
_PLAIN_FIELDS = tuple(f.name for f in fields(Sample) if f.name not in COLUMN_TYPECODES and f.name not in _NUMPY_FIELDS)
_CANONICAL = {name: np.dtype(code).newbyteorder("<") for name, code in COLUMN_TYPECODES.items()}


def state_digest(state: dict[str, Any], *, legacy: bool = False, kind: str = DIGEST) -> str:
    """`state`'s digest of `kind` (module docstring); `legacy`: kind "json" (what FORMAT-1 records hold)."""
    kind = "json" if legacy else kind
    rest = {k: v for k, v in state.items() if k != "weight_version"}
    if kind == "json":
        plain = json.loads(json.dumps(json_state(rest), default=str))
        return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()
    if kind == "orjson":
        return hashlib.sha256(orjson.dumps(json_state(rest), default=str, option=_ORJSON)).hexdigest()
    if kind != "raw":
        raise ValueError(f"state digest kind {kind!r}: expected one of {', '.join(KINDS)}")
    buffer = rest.pop("buffer", None)
    groups, about = _buffer_groups(buffer)
    digest = hashlib.sha256(orjson.dumps([rest, about], default=str, option=_ORJSON))
    if groups is not None:
        for group in groups:
            digest.update(b"G%d;" % len(group))
            for sample in group:
                _update_with_sample(digest, sample)
    return digest.hexdigest()


def _buffer_groups(buffer: Any) -> tuple[list[list[Sample]] | None, Any]:
    """A buffer's samples (as Samples, from a snapshot or from `state_dict()`'s JSON) and the rest of it; a buffer
    of another shape (a custom scheduler's): no samples, and all of it as JSON."""
    if isinstance(buffer, BufferSnapshot):
        return buffer.groups, {"version": buffer.version}
    if isinstance(buffer, dict) and isinstance(buffer.get("groups"), list):
        try:
            groups = [[Sample.from_dict(s) for s in g] for g in buffer["groups"]]
        except (TypeError, ValueError, KeyError, AttributeError):
            return None, buffer
        return groups, {k: v for k, v in buffer.items() if k != "groups"}
    return None, buffer


def _update_with_sample(digest: Any, sample: Sample) -> None:
    plain: dict[str, Any] = {name: getattr(sample, name) for name in _PLAIN_FIELDS}
    plain["status"] = sample.status.value
    if any(getattr(sample, name) is not None for name in _NUMPY_FIELDS):  # (rare: routing replay, score centering)
        as_json = sample.to_dict()  # their JSON form, which a checkpoint round-trips exactly
        plain.update({name: as_json.get(name) for name in _NUMPY_FIELDS})
    columns = [_column_bytes(name, sample.column(name)) for name in COLUMN_TYPECODES]
    digest.update(orjson.dumps([plain, [len(c) for c in columns]], default=str, option=_ORJSON))
    for column in columns:
        digest.update(column)


def _column_bytes(name: str, values: Any) -> memoryview:
    """A per-token column's numbers as little-endian int64 / float64 bytes, from a compact column as it is: the
    same bytes whichever form it is held in (a narrow `array('i'/'f')` is widened: data/column_forms.py)."""
    dtype = _CANONICAL[name]
    if isinstance(values, array) and values.typecode == COLUMN_TYPECODES[name] and np.dtype(values.typecode) == dtype:
        numbers = np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype)
    elif isinstance(values, array) and values.typecode in COLUMN_FORMS[name]:
        numbers = (np.frombuffer(values, dtype=DTYPES[values.typecode]).astype(dtype) if len(values)
                   else np.zeros(0, dtype))
    else:
        numbers = np.asarray(values if len(values) else [], dtype=dtype)
    if dtype.kind == "f" and len(numbers) and not np.isfinite(numbers).all():
        numbers = np.where(np.isfinite(numbers), numbers, np.nan)
    return memoryview(numbers).cast("B")
