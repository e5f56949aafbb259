"""The retained-rollouts journal on disk: one record file per rollout, its per-token data as raw machine numbers.

Owns the format and the files under `<run_dir>/retained/` (controller/retention.py owns what goes in and what a
resume keeps):

    retained/rollout-00000012.rec     one record (FORMAT 3, or 2: read): a JSON line, then the raw bytes it describes
    retained/rollout-00000013.rec.tmp a record being written (a crash leaves it: torn, ignored, removed)
    retained/rollouts.jsonl           FORMAT 1 (hpc_rl before Nov 29): read, and rewritten as records by a resume

A record's JSON line holds the rollout (id, weight version, session, `state_before` digest, `state_after`, metrics)
and its groups' samples in `Sample.to_dict`'s form, less their per-token data: the compact columns
(`Sample.compact_columns`: tokens, log-probs and weight versions as `array('q'/'d')`, tokens and log-probs also
narrow, `array('i'/'f')`: data/column_forms.py) and the numpy fields
(routed experts, top-k log-probs) follow the line as their own bytes, each described in its sample's `"raw"`
([field, numpy dtype, shape], in order; a column in the narrowest dtype that holds its numbers exactly, or with a
4th item, the value of all its elements, and no bytes) and read back as the same arrays (the columns as compact
columns again: in the form stored, narrow or wide; the same numbers).
Why: as JSON, every token was a Python object to make (reading `response_token_ids` turns a column into a list)
and to print (0.37 CPU-s per 1,000 full-length samples at bench_scale's N=256, as much as the rest of the
controller's per-sample work), and the trainer's packing then walked those lists again; raw, a sample costs its
JSON line and one kernel copy of its bytes (`os.writev` straight from the arrays). A per-token field held as a list
(a plug-in assigned one) stays in the JSON line, as before.
FORMAT 3 (Nov 29, evening) does the same for the partial buffer in `state_after` when it is a `BufferSnapshot`
(the controller's, rollout/buffer_snapshot.py): its samples' headers as `"buffer": {"version", "raw_groups"}`, their
bytes after the groups', read back as a `BufferSnapshot`; and says its `state_before`'s digest kind ("digest":
controller/state_digest.py). In partial mode the buffer was JSON lists, ~1 CPU-s of the journal threads per 4,096
samples at bench_scale's N=256. A FORMAT-2 record (its buffer as JSON, its digest orjson's) reads as it did.

Durability: a record is written to `.rec.tmp`, fsync'd, renamed to `.rec` and the directory fsync'd, so a crash
leaves the records before it whole and at most one `.tmp` (ignored, and removed by the next write). No pickle.
"""

from __future__ import annotations

import logging
import os
import re
from array import array
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from hpc_rl.controller.state_digest import DIGEST, KINDS
from hpc_rl.data.column_forms import COLUMN_FORMS, DTYPES
from hpc_rl.data.samples import COLUMN_TYPECODES, Group, Sample
from hpc_rl.data.uniform_column import UniformColumn
from hpc_rl.rollout.buffer_snapshot import BufferSnapshot

log = logging.getLogger(__name__)

JOURNAL = Path("retained")
"""Under the run dir (the shared filesystem: what must outlive the trainer's job lives there)."""
FORMAT = 3
FORMATS = (2, 3)
"""Record formats read: 3 adds the partial buffer's samples raw (`state_after`'s "raw_groups") and the digest kind
("digest"); a FORMAT-2 record's `state_before` is orjson's digest."""
LEGACY_FORMAT = 1
LEGACY_FILE = "rollouts.jsonl"
"""FORMAT 1's one file of JSON lines (per-token data as JSON lists), in the same directory."""
MAX_RECORDS = 8
"""Records kept at most (the newest): more than a resume can use (a checkpoint every rollout or few)."""

_RECORD = re.compile(r"rollout-(\d+)\.rec")
_NUMPY_FIELDS = ("routed_experts", "top_logprob_ids", "top_logprobs")
_JSON_FIELDS = tuple(f.name for f in fields(Sample) if f.name not in _NUMPY_FIELDS)
_COLUMN_DTYPES = {name: np.dtype(code) for name, code in COLUMN_TYPECODES.items()}
_DTYPE_STR = {code: dtype.str for code, dtype in DTYPES.items()}
_INT32 = np.iinfo(np.int32)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass
class RetainedBatch:
    """One journal record: rollout `rollout_id`'s kept groups, generated with `weight_version`."""

    rollout_id: int
    weight_version: int
    session_id: str | None
    state_before: str
    """`state_digest` of the scheduler state the rollout started from."""
    state_after: dict[str, Any]
    """The scheduler state it left (data cursor, counters, partial buffer: `state_dict()`'s JSON form, or a
    `BufferSnapshot`, which is written raw and read back as one)."""
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)
    stored: Path | None = field(default=None, compare=False, repr=False)
    """Its record file (None: not written as one yet, e.g. read from a FORMAT-1 journal)."""
    digest_kind: str = field(default=DIGEST, compare=False, repr=False)
    """`state_before`'s kind (controller/state_digest.py): "json" in a FORMAT-1 record, "orjson" in a FORMAT-2 one."""
    file_only: bool = field(default=False, compare=False, repr=False)
    """A `stub()`: its groups and state are only in its record file."""

    def stub(self) -> "RetainedBatch":
        """This written record without its groups and state (what the journal's bookkeeping needs: id, file).
        Why: a rollout's samples (~60 kB each at full length) stayed alive in the controller's list of records
        until a checkpoint dropped them, up to `MAX_RECORDS` rollouts after the trainer had them."""
        if self.stored is None:
            raise ValueError(f"rollout {self.rollout_id}'s record is not written: a stub would lose it")
        return RetainedBatch(rollout_id=self.rollout_id, weight_version=self.weight_version,
                             session_id=self.session_id, state_before=self.state_before, state_after={}, groups=[],
                             stored=self.stored, digest_kind=self.digest_kind, file_only=True)

    @property
    def num_samples(self) -> int:
        return sum(len(g) for g in self.groups)

    def encode(self) -> tuple[bytes, list[memoryview]]:
        """FORMAT 3: the JSON line, and the bytes that follow it (views of the arrays themselves, not copies)."""
        buffers: list[memoryview] = []
        groups = [[_sample_header(s, buffers) for s in g] for g in self.groups]
        state_after = self.state_after
        buffer = state_after.get("buffer")
        if isinstance(buffer, BufferSnapshot):  # its samples as the groups' are, their bytes after the groups'
            state_after = {**state_after, "buffer": {"version": buffer.version, "raw_groups": [
                [_sample_header(s, buffers) for s in g] for g in buffer.groups]}}
        payload = sum(b.nbytes for b in buffers)
        line = orjson.dumps({"format": FORMAT, "rollout_id": self.rollout_id, "weight_version": self.weight_version,
                             "session_id": self.session_id, "state_before": self.state_before,
                             "digest": self.digest_kind, "state_after": state_after, "metrics": self.metrics,
                             "groups": groups, "payload_bytes": payload}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        return line, buffers

    @classmethod
    def decode(cls, data: bytes) -> "RetainedBatch":
        """A FORMAT-2 or -3 record file's bytes (ValueError/KeyError/TypeError: not a whole record)."""
        end = data.find(b"\n")
        if end < 0:
            raise ValueError("no JSON line")
        header = orjson.loads(data[:end])
        if header.get("format") not in FORMATS:
            raise ValueError(f"format {header.get('format')!r}, expected one of {FORMATS}")
        kind = header.get("digest", "orjson")
        if kind not in KINDS:
            raise ValueError(f"state digest kind {kind!r}, expected one of {KINDS}")
        payload = memoryview(data)[end + 1:]
        if len(payload) != header["payload_bytes"]:
            raise ValueError(f"{len(payload)} bytes after the JSON line, it says {header['payload_bytes']}")
        reader = _RawReader(payload)
        groups = [[_sample_from_header(s, reader) for s in g] for g in header["groups"]]
        buffer = header["state_after"].get("buffer")
        if isinstance(buffer, dict) and "raw_groups" in buffer:
            header["state_after"]["buffer"] = BufferSnapshot(
                groups=[[_sample_from_header(s, reader) for s in g] for g in buffer["raw_groups"]],
                version=int(buffer["version"]))
        if reader.offset != len(payload):
            raise ValueError(f"{len(payload) - reader.offset} bytes after the JSON line are not described in it")
        batch = cls._from_header(header, groups)
        batch.digest_kind = kind
        return batch

    @classmethod
    def from_legacy_json(cls, data: dict[str, Any]) -> "RetainedBatch":
        """A FORMAT-1 line's object (per-token data as JSON lists; read as lists, as then)."""
        if data.get("format") != LEGACY_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {LEGACY_FORMAT} in {LEGACY_FILE}")
        batch = cls._from_header(data, [[_legacy_sample(s) for s in g] for g in data["groups"]])
        batch.digest_kind = "json"
        return batch

    @classmethod
    def _from_header(cls, data: dict[str, Any], groups: list[Group]) -> "RetainedBatch":
        return cls(rollout_id=int(data["rollout_id"]), weight_version=int(data["weight_version"]),
                   session_id=data.get("session_id"), state_before=str(data["state_before"]),
                   state_after=data["state_after"], metrics=dict(data.get("metrics") or {}), groups=groups)


def _sample_header(sample: Sample, buffers: list[memoryview]) -> dict[str, Any]:
    """`Sample.to_dict`'s form without its deep copy and without the per-token data held as arrays (appended to
    `buffers`, described in "raw"): a compact column is never turned into a list here."""
    held = sample.compact_columns(expand_uniform=False)  # a one-version column is written as its value, not read
    data = {name: getattr(sample, name) for name in _JSON_FIELDS if name not in held}
    data["status"] = sample.status.value
    raw: list[list[Any]] = []
    for name, values in held.items():
        entry, stored = _column_raw(name, values)
        raw.append(entry)
        if stored is not None:
            buffers.append(stored)
    for name in _NUMPY_FIELDS:
        value = getattr(sample, name)
        if value is not None:
            value = np.ascontiguousarray(value)
            raw.append([name, value.dtype.str, list(value.shape)])
            buffers.append(memoryview(value.reshape(-1)).cast("B"))
    if raw:
        data["raw"] = raw
    if getattr(sample, "remove_sample", False):  # slime's rollout_sample_filter_path mark (not a field)
        data["remove_sample"] = True
    return data


def _column_raw(name: str, values: array | UniformColumn) -> tuple[list[Any], memoryview | None]:
    """A compact column's "raw" entry ([name, stored dtype, [length]], + [value] when every element is that value:
    no bytes) and its bytes, in the narrowest form that holds its numbers exactly: half the bytes for the kernel to
    copy, fsync and keep on the shared filesystem, for a pass or two over a column that is in cache after the first.
    Weight versions are one version throughout but in samples that span a weight update; token ids fit int32;
    log-probs are the engines' float32 values (float64 only when one is not).
    Measured (2,048 samples of 1,500-3,500 tokens, caches cold as after a rollout, whole `Retention._write`): 40 us
    per sample with min/max for the token ids and a float comparison for the log-probs, 37.5 with one OR pass and a
    byte comparison of the log-probs' round trip; the same columns unnarrowed, 25.5 (twice the bytes).
    A column already narrow (`array('i'/'f')`, as the answer workers send them) is written as it is."""
    if isinstance(values, UniformColumn):  # one weight version throughout (data/uniform_column.py): no bytes
        return [name, _DTYPE_STR["q"], [len(values)], values.value], None
    numbers = np.frombuffer(values, dtype=DTYPES[values.typecode]) if len(values) else None
    if numbers is None:
        return [name, _DTYPE_STR[values.typecode], [0]], None
    if values.typecode == "i":
        first = values[0]
        if values[-1] == first and bool((numbers == first).all()):
            return [name, _DTYPE_STR["i"], [len(values)], first], None
    elif values.typecode == "q":
        first = values[0]
        if values[-1] == first and bool((numbers == first).all()):
            return [name, _DTYPE_STR["q"], [len(values)], first], None
        # all in [0, 2**31) iff their OR is (one pass); else (a negative number) the two-pass range check
        if 0 <= int(np.bitwise_or.reduce(numbers)) <= _INT32.max or (
                numbers.min() >= _INT32.min and numbers.max() <= _INT32.max):
            numbers = numbers.astype(np.int32)
    elif values.typecode == "d":
        narrow = numbers.astype(np.float32)
        if narrow.astype(np.float64).tobytes() == numbers.tobytes():  # the same bits back (NaNs too; -0.0 kept)
            numbers = narrow
    return [name, numbers.dtype.str, [len(values)]], memoryview(numbers).cast("B")


def _stored_form(name: str, dtype: np.dtype) -> str:
    """The typecode a column stored as `dtype` is read back as: its own form when it is one of the column's
    (`COLUMN_FORMS`, native byte order), else the column's wide one."""
    for code in COLUMN_FORMS[name]:
        if DTYPES[code] == dtype:
            return code
    return COLUMN_TYPECODES[name]


class _RawReader:
    """The bytes after a record's JSON line, taken in order."""

    def __init__(self, payload: memoryview) -> None:
        self.payload, self.offset = payload, 0

    def take(self, dtype: np.dtype, shape: list[int]) -> memoryview:
        end = self.offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end > len(self.payload):
            raise ValueError(f"a sample's raw data ends past the record ({end} > {len(self.payload)} bytes)")
        taken, self.offset = self.payload[self.offset:end], end
        return taken


def _sample_from_header(data: dict[str, Any], reader: _RawReader) -> Sample:
    data = dict(data)
    remove = data.pop("remove_sample", False)
    raw = data.pop("raw", [])
    sample = Sample.from_dict(data)
    columns: dict[str, array] = {}
    for name, dtype_str, shape, *fill in raw:
        dtype = np.dtype(dtype_str)
        if name in COLUMN_TYPECODES and fill:  # every element that value
            columns[name] = (UniformColumn(fill[0], int(shape[0])) if name == "weight_versions"
                             else array(_stored_form(name, dtype), fill) * int(shape[0]))
            continue
        taken = reader.take(dtype, shape)
        if name in COLUMN_TYPECODES:
            code = _stored_form(name, dtype)
            column = array(code)
            if dtype == DTYPES[code]:  # kept in the form stored (narrow or wide: data/column_forms.py)
                column.frombytes(taken)
            else:  # stored in another dtype (or the other byte order): the same numbers, wide
                column.frombytes(np.frombuffer(taken, dtype=dtype).astype(_COLUMN_DTYPES[name]).tobytes())
            columns[name] = column
        elif name in _NUMPY_FIELDS:
            setattr(sample, name, np.frombuffer(taken, dtype=dtype).reshape(shape).copy())
        else:
            raise ValueError(f"raw field {name!r} is not a sample's per-token field")
    sample.hold_columns(columns)
    if remove:
        sample.remove_sample = True  # type: ignore[attr-defined]
    return sample


def _legacy_sample(data: dict[str, Any]) -> Sample:
    data = dict(data)
    remove = data.pop("remove_sample", False)
    sample = Sample.from_dict(data)
    if remove:
        sample.remove_sample = True  # type: ignore[attr-defined]
    return sample


class RolloutJournal:
    """The directory: write a record whole and durable, read back the whole records, keep some, drop all."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def record_path(self, rollout_id: int) -> Path:
        return self.path / f"rollout-{rollout_id:08d}.rec"

    def write(self, batch: RetainedBatch, encoded: tuple[bytes, list[memoryview]] | None = None) -> None:
        """`batch` as its record file (replacing one of the same rollout), fsync'd; `encoded`: `batch.encode()`."""
        line, buffers = encoded if encoded is not None else batch.encode()
        final = self.record_path(batch.rollout_id)
        tmp = final.with_name(final.name + ".tmp")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(descriptor, [line, *buffers])
                os.fsync(descriptor)
                _drop_cached(descriptor)
            finally:
                os.close(descriptor)
            os.replace(tmp, final)
            self._sync_directory()
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise OSError(error.errno, f"{final}: cannot write a retained rollout: {error.strerror}") from error
        batch.stored = final

    def _sync_directory(self) -> None:
        """The rename and unlinks durable (best effort: some filesystems refuse fsync on a directory)."""
        try:
            descriptor = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            os.fsync(descriptor)
        except OSError:
            pass
        finally:
            os.close(descriptor)

    def read(self) -> tuple[list[RetainedBatch], list[str]]:
        """The whole records by rollout id, and what was skipped (a record cut short by a crash, one that does not
        parse). A FORMAT-1 journal's records are read too; a record file of the same rollout wins over one."""
        if not self.path.is_dir():
            return [], []
        skipped: list[str] = []
        batches = {b.rollout_id: b for b in self._read_legacy(skipped)}
        for path in sorted(self.path.iterdir()):
            if path.name.endswith(".rec.tmp"):
                skipped.append(f"{path.name}: cut short ({path.stat().st_size} bytes, a crash mid-write)")
            elif _RECORD.fullmatch(path.name):
                try:
                    batch = RetainedBatch.decode(path.read_bytes())
                except (ValueError, KeyError, TypeError) as error:
                    skipped.append(f"{path.name}: {type(error).__name__}: {error}")
                    continue
                batch.stored = path
                batches[batch.rollout_id] = batch
        return [batches[k] for k in sorted(batches)], skipped

    def _read_legacy(self, skipped: list[str]) -> list[RetainedBatch]:
        try:
            data = (self.path / LEGACY_FILE).read_bytes()
        except FileNotFoundError:
            return []
        batches: list[RetainedBatch] = []
        lines = data.split(b"\n")
        if lines[-1]:
            skipped.append(f"{LEGACY_FILE} line {len(lines)}: cut short ({len(lines[-1])} bytes, a crash mid-write)")
        for number, line in enumerate(lines[:-1], start=1):
            if not line.strip():
                continue
            try:
                batches.append(RetainedBatch.from_legacy_json(orjson.loads(line)))
            except (ValueError, KeyError, TypeError) as error:
                skipped.append(f"{LEGACY_FILE} line {number}: {type(error).__name__}: {error}")
        return batches

    def keep_only(self, keep: list[RetainedBatch]) -> None:
        """Leave exactly `keep`'s records: those not in a record file yet (read from a FORMAT-1 journal) are
        written, every other file goes (the directory too, when nothing is left). Each step leaves whole records."""
        for batch in keep:
            if batch.stored is None or not batch.stored.exists():
                if batch.file_only:  # (its file went: nothing left to write it from; a resume generates it again)
                    log.warning("%s: gone, rollout %d is not retained", batch.stored, batch.rollout_id)
                    continue
                self.write(batch)
        if not self.path.is_dir():
            return
        wanted = {self.record_path(b.rollout_id).name for b in keep}
        for path in self.path.iterdir():
            if path.name not in wanted and (path.name == LEGACY_FILE or path.name.endswith((".rec", ".rec.tmp"))):
                path.unlink(missing_ok=True)
        self._sync_directory()
        if not keep:
            try:
                self.path.rmdir()
            except OSError:  # something else in it (not ours): leave it
                pass


def _drop_cached(descriptor: int) -> None:
    """Give the record's page-cache pages back now that they are on disk (clean: read again only by a resume).
    Why: the pages a write allocates were most of its CPU. On this machine (a VM; 12 GB free) 56 MB records kept in
    the cache cost 92-97 ms of the writing thread's CPU each in `writev`; with each record's pages dropped after its
    fsync, 10-12 ms (+2.5 ms for the drop): the next record's pages come from those just freed. A memory cgroup near
    its limit (a Slurm job's) makes the writer reclaim first, the same way. Best effort."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _write_all(descriptor: int, buffers: list[bytes | memoryview]) -> None:
    """Every buffer's bytes, in order, from the buffers themselves (`os.writev`, `_IOV_MAX` at a time)."""
    views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers if len(b)]
    while views:
        written = os.writev(descriptor, views[:_IOV_MAX])
        done = 0
        while done < len(views) and written >= views[done].nbytes:
            written -= views[done].nbytes
            done += 1
        views = views[done:]
        if written:
            views[0] = views[0][written:]
