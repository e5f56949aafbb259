"""Retained rollouts: batches generated but not yet trained survive the trainer, and a resumed run trains them
first instead of generating them again (issue 35; docs/faults.md, "Retained rollouts").

Owns the journal of one run (`<run_dir>/retained/rollouts.jsonl`) and the policy around it:
  - `keep`: each rollout, as its generation completes, is appended as one JSON line (its kept groups with the
    engines' tokens and log-probs, its metrics, the weight version it was generated with, the run's
    `rollout_session_id`, a digest of the scheduler state it started from and the whole scheduler state it left:
    data cursor, counters and the partial-rollout buffer); written whole and fsync'd in a thread, off the loop;
  - `checkpointed(k)`: a checkpoint holds rollout k trained, so records up to k are dropped (the file stays
    small: what lies between the last checkpoint and now, `MAX_RECORDS` at most);
  - `attach`: a resumed controller reads the journal once and keeps the records that continue its checkpoint
    exactly: same session id, rollout ids from the checkpoint's next one on without a gap, each starting from the
    state the one before left (the first from the checkpoint's), generated with the checkpoint's weight version or
    an older one within `allowed_lag` versions. Anything else is dropped, and said;
  - `take(k, state)`: rollout k's retained batch, when there is one for exactly that state (`Rollouts` trains it
    instead of generating).
Not here: when rollouts are generated (`Rollouts`), the checkpoint (`Checkpoints`), the engines' weights on resume
(`WeightUpdates.start` pushes the checkpoint's before the first rollout).

Format: one JSON object per line, `FORMAT` 1; a crash mid-write leaves a readable prefix (the torn last line is
ignored and cut off before the next append). No pickle: samples in `Sample.to_dict`'s form (plain JSON types).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from hpc_rl.controller.fault_hooks import (HOLD_CONTROLLER_AFTER_RETAIN, KILL_CONTROLLER_AFTER_RETAIN,
                                          hold_here_if_asked, kill_here_if_asked)
from hpc_rl.data.samples import Group, Sample

log = logging.getLogger(__name__)

JOURNAL = Path("retained") / "rollouts.jsonl"
"""Under the run dir (the shared filesystem: what must outlive the trainer's job lives there)."""
FORMAT = 1
MAX_RECORDS = 8
"""Records kept at most (the newest): more than a resume can use (a checkpoint every rollout or few)."""


def state_digest(state: dict[str, Any]) -> str:
    """A scheduler state's identity, its weight version aside (the version the engines serve, set apart)."""
    plain = json.loads(json.dumps({k: v for k, v in state.items() if k != "weight_version"}, default=str))
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


_NUMPY_FIELDS = ("routed_experts", "top_logprob_ids", "top_logprobs")
_PLAIN_FIELDS = tuple(f.name for f in fields(Sample) if f.name not in _NUMPY_FIELDS)


def _sample_to_json(sample: Sample) -> dict[str, Any]:
    """`Sample.to_dict`'s form without its deep copy (`dataclasses.asdict` copied every token list: 40 ms of a
    sample of 8,192 tokens, against 1 ms for orjson to write the lists as they are); the arrays as to_dict has them."""
    data = {name: getattr(sample, name) for name in _PLAIN_FIELDS}
    data["status"] = sample.status.value
    if any(getattr(sample, name) is not None for name in _NUMPY_FIELDS):
        arrays = dataclasses.replace(sample, prompt="", prompt_token_ids=[], response_token_ids=[],
                                     response_logprobs=[], weight_versions=[], loss_mask=None, metadata={}).to_dict()
        data.update({name: arrays[name] for name in _NUMPY_FIELDS})
    if getattr(sample, "remove_sample", False):  # slime's rollout_sample_filter_path mark (not a field)
        data["remove_sample"] = True
    return data


def _sample_from_json(data: dict[str, Any]) -> Sample:
    data = dict(data)
    remove = data.pop("remove_sample", False)
    sample = Sample.from_dict(data)
    if remove:
        sample.remove_sample = True  # type: ignore[attr-defined]
    return sample


@dataclass
class RetainedBatch:
    """One journal record: rollout `rollout_id`'s kept groups, generated with `weight_version`."""

    rollout_id: int
    weight_version: int
    session_id: str | None
    state_before: str
    """`state_digest` of the scheduler state the rollout started from."""
    state_after: dict[str, Any]
    """The scheduler state it left (data cursor, counters, partial buffer)."""
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(len(g) for g in self.groups)

    def to_line(self) -> bytes:
        return orjson.dumps({"format": FORMAT, "rollout_id": self.rollout_id, "weight_version": self.weight_version,
                             "session_id": self.session_id, "state_before": self.state_before,
                             "state_after": self.state_after, "metrics": self.metrics,
                             "groups": [[_sample_to_json(s) for s in g] for g in self.groups]},
                            option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RetainedBatch":
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        return cls(rollout_id=int(data["rollout_id"]), weight_version=int(data["weight_version"]),
                   session_id=data.get("session_id"), state_before=str(data["state_before"]),
                   state_after=data["state_after"], metrics=dict(data.get("metrics") or {}),
                   groups=[[_sample_from_json(s) for s in g] for g in data["groups"]])


class RolloutJournal:
    """The file: append a record whole and durable, read back the whole records, keep some, drop all."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, line: bytes) -> None:
        """One record, fsync'd; a torn tail a crash left is cut off first (so the file stays readable)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(descriptor).st_size
            end = self._whole_end(descriptor, size)
            if end != size:
                os.ftruncate(descriptor, end)
            os.lseek(descriptor, end, os.SEEK_SET)
            view = memoryview(line)
            while view:
                view = view[os.write(descriptor, view):]
            os.fsync(descriptor)
        except OSError as error:
            raise OSError(error.errno, f"{self.path}: cannot write a retained rollout: {error.strerror}") from error
        finally:
            os.close(descriptor)

    @staticmethod
    def _whole_end(descriptor: int, size: int) -> int:
        """The offset just after the last newline (0: none)."""
        position = size
        while position > 0:
            chunk = min(65536, position)
            position -= chunk
            data = os.pread(descriptor, chunk, position)
            newline = data.rfind(b"\n")
            if newline >= 0:
                return position + newline + 1
        return 0

    def read(self) -> tuple[list[RetainedBatch], list[str]]:
        """The whole records in order, and what was skipped (a torn last line, a record that does not parse)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], []
        batches: list[RetainedBatch] = []
        skipped: list[str] = []
        lines = data.split(b"\n")
        if lines[-1]:
            skipped.append(f"line {len(lines)}: cut short ({len(lines[-1])} bytes, a crash mid-write)")
        for number, line in enumerate(lines[:-1], start=1):
            if not line.strip():
                continue
            try:
                batches.append(RetainedBatch.from_json(orjson.loads(line)))
            except (ValueError, KeyError, TypeError) as error:
                skipped.append(f"line {number}: {type(error).__name__}: {error}")
        return batches, skipped

    def keep_only(self, keep: list[RetainedBatch]) -> None:
        """Rewrite the file with `keep` (atomically: a crash leaves the old file or the new one)."""
        if not keep:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as out:
            for batch in keep:
                out.write(batch.to_line())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)


class Retention:
    """The run's retained rollouts (see the module docstring). `enabled` False: every call does nothing."""

    def __init__(self, run_dir: str | Path, *, session_id: str | None, allowed_lag: int, enabled: bool = True,
                 print_fn: Any = print) -> None:
        self.journal = RolloutJournal(Path(run_dir) / JOURNAL)
        self.session_id, self.allowed_lag, self.enabled = session_id, allowed_lag, enabled
        self.print = print_fn
        self._records: list[RetainedBatch] = []
        """What the journal holds (this attempt's view), oldest first."""
        self._ready: dict[int, RetainedBatch] = {}
        """Attached at resume: rollout id -> its batch, to train instead of generating."""
        self._lock = threading.Lock()
        """The file and `_records`: a record written in a thread (async mode: the rollout ahead) while a
        checkpoint drops older ones in another."""
        self.trained_samples = 0
        """Samples trained from retained batches in this attempt (= generations saved)."""
        self.write_seconds = 0.0
        self.written_samples = 0

    def _say(self, line: str) -> None:
        log.info("%s", line)
        self.print(line)

    # -- writing -------------------------------------------------------------------------------------------
    async def keep(self, rollout_id: int, weight_version: int, state_before: dict[str, Any], groups: list[Group],
                   metrics: dict[str, float], state_after: dict[str, Any]) -> None:
        """Journal rollout `rollout_id` (generated with `weight_version` from the scheduler state `state_before`,
        leaving `state_after`: snapshots nobody changes), durable when this returns; the encoding and the write run
        in a thread. A record that cannot be written costs the resume its retention, not the run: it is logged."""
        if not self.enabled:
            return
        start = time.perf_counter()
        try:
            samples = await asyncio.to_thread(self._write, rollout_id, weight_version, state_before, groups,
                                              metrics, state_after)
        except (OSError, TypeError, ValueError) as error:
            log.warning("rollout %d not retained: %s", rollout_id, error)
            return
        self.write_seconds += time.perf_counter() - start
        self.written_samples += samples
        kill_here_if_asked(KILL_CONTROLLER_AFTER_RETAIN, rollout_id)  # tests: generated, journaled, not trained
        await hold_here_if_asked(HOLD_CONTROLLER_AFTER_RETAIN, rollout_id)  # (the Slurm test scancels the job)

    def _write(self, rollout_id: int, weight_version: int, state_before: dict[str, Any], groups: list[Group],
               metrics: dict[str, float], state_after: dict[str, Any]) -> int:
        batch = RetainedBatch(rollout_id=rollout_id, weight_version=weight_version, session_id=self.session_id,
                              state_before=state_digest(state_before), state_after=state_after, groups=groups,
                              metrics={k: float(v) for k, v in metrics.items()})
        line = batch.to_line()
        with self._lock:
            self._records = [r for r in self._records if r.rollout_id != rollout_id] + [batch]
            if len(self._records) > MAX_RECORDS:
                self._records = self._records[-MAX_RECORDS:]
                self.journal.keep_only(self._records)
            else:
                self.journal.append(line)
        return batch.num_samples

    async def checkpointed(self, rollout_id: int) -> None:
        """A checkpoint holds rollout `rollout_id` trained: its record and older ones are not needed any more."""
        if self.enabled:
            await asyncio.to_thread(self._drop_up_to, rollout_id)

    def _drop_up_to(self, rollout_id: int) -> None:
        with self._lock:
            if any(r.rollout_id <= rollout_id for r in self._records):
                self._records = [r for r in self._records if r.rollout_id > rollout_id]
                self.journal.keep_only(self._records)

    # -- resuming ------------------------------------------------------------------------------------------
    def attach(self, *, next_rollout_id: int, weight_version: int, scheduler_state: dict[str, Any] | None) -> None:
        """Read the journal once, before the first rollout: with a checkpoint's controller state
        (`scheduler_state`, its `next_rollout_id` and `weight_version`), keep the records that continue it (see
        the module docstring) for `take`; without one (a fresh start), drop the journal. Says what it kept and
        what it dropped, and why."""
        if not self.enabled:
            return
        records, skipped = self.journal.read()
        for reason in skipped:
            log.warning("%s: %s (ignored)", self.journal.path, reason)
        if not records:
            self._records = []
            return
        if scheduler_state is None:
            self._drop_all(records, "this run starts fresh (no checkpoint's controller state to continue)")
            return
        sessions = {r.session_id for r in records}
        if sessions != {self.session_id}:
            named = ", ".join(repr(s) for s in sorted(sessions, key=str))
            self._drop_all(records, f"they belong to session {named}, this run's rollout_session_id is "
                                    f"{self.session_id!r} (a different session starts fresh)")
            return
        digest, expected = state_digest(scheduler_state), next_rollout_id
        for record in records:
            if record.rollout_id < expected:
                continue  # trained and checkpointed already
            why = self._refusal(record, expected, digest, weight_version)
            if why is not None:
                self._say(f"hpc_rl: retained rollouts from rollout {record.rollout_id} on are generated again: {why}")
                break
            self._ready[record.rollout_id] = record
            digest, expected = state_digest(record.state_after), expected + 1
        self._records = list(self._ready.values())
        self.journal.keep_only(self._records)
        if self._ready:
            samples = sum(b.num_samples for b in self._ready.values())
            self._say(f"hpc_rl: re-attached to session {self.session_id!r}: {len(self._ready)} retained rollout(s) "
                       f"{sorted(self._ready)} ({samples} samples) are trained first, not generated again")

    def _refusal(self, record: RetainedBatch, expected: int, digest: str, version: int) -> str | None:
        if record.rollout_id != expected:
            return f"rollout {expected} is not retained (the journal goes on at {record.rollout_id})"
        if record.state_before != digest:
            return (f"rollout {expected}'s record started from another data cursor / partial buffer than the "
                    "checkpoint holds (it follows a rollout that is not in this checkpoint)")
        if record.weight_version > version:
            return (f"rollout {expected} was generated with weights v{record.weight_version}, newer than the "
                    f"checkpoint's v{version} (weights this resume does not have)")
        if version - record.weight_version > self.allowed_lag:
            return (f"rollout {expected} was generated with weights v{record.weight_version}, "
                    f"{version - record.weight_version} versions behind the checkpoint's v{version}; the run allows "
                    f"{self.allowed_lag} (rollout.max_staleness, else 1 in async mode and 0 in sync mode)")
        return None

    def _drop_all(self, records: list[RetainedBatch], why: str) -> None:
        ids = sorted({r.rollout_id for r in records})
        self._say(f"hpc_rl: {len(records)} retained rollout(s) {ids} in {self.journal.path} dropped: {why}")
        self._records = []
        self.journal.keep_only([])

    def take(self, rollout_id: int, scheduler_state: dict[str, Any]) -> RetainedBatch | None:
        """Rollout `rollout_id`'s retained batch, if attached and it starts from `scheduler_state` (then it is
        counted as trained: `trained_samples`); None: generate it."""
        batch = self._ready.pop(rollout_id, None)
        if batch is None:
            return None
        if batch.state_before != state_digest(scheduler_state):  # cannot happen after attach's checks: be sure
            self._say(f"hpc_rl: retained rollout {rollout_id} does not follow the state now; generated again")
            self._ready.clear()
            return None
        self.trained_samples += batch.num_samples
        log.info("rollout %d: %d retained samples (weights v%d) trained instead of generated", rollout_id,
                 batch.num_samples, batch.weight_version)
        return batch


    def summary(self) -> dict[str, Any]:
        """For status.json: rollouts journaled and not yet checkpointed, those a resume attached and has not
        trained yet, and the samples trained from retained batches in this attempt (generations saved)."""
        with self._lock:
            journaled = sorted(r.rollout_id for r in self._records)
        return {"journaled": journaled, "to_train": sorted(self._ready), "generations_saved": self.trained_samples}


def allowed_lag(*, max_staleness: int | None, async_rollout: bool) -> int:
    """How many weight versions a retained batch may lag the checkpoint it is trained after: the run's
    `max_staleness`, else what the mode trains anyway (async: one version behind; sync: none)."""
    if max_staleness is not None:
        return max_staleness
    return 1 if async_rollout else 0
