"""Retained rollouts: batches generated but not yet trained survive the trainer, and a resumed run trains them
first instead of generating them again (issue 35; docs/faults.md, "Retained rollouts").

Owns the journal of one run (`<run_dir>/retained/`, one record per rollout: controller/retained_journal.py) and the
policy around it:
  - `keep`: each rollout, as its generation completes, is journaled as one record (its kept groups with the
    engines' tokens and log-probs, its metrics, the weight version it was generated with, the run's
    `rollout_session_id`, a digest of the scheduler state it started from and the whole scheduler state it left:
    data cursor, counters and the partial-rollout buffer); written whole and fsync'd in a thread, off the loop;
  - `checkpointed(k)`: a checkpoint holds rollout k trained, so records up to k are dropped (the journal stays
    small: what lies between the last checkpoint and now, `MAX_RECORDS` at most);
  - `attach`: a resumed controller reads the journal once and keeps the records that continue its checkpoint
    exactly: same session id, rollout ids from the checkpoint's next one on without a gap, each starting from the
    state the one before left (the first from the checkpoint's), generated with the checkpoint's weight version or
    an older one within `allowed_lag` versions. Anything else is dropped, and said;
  - `take(k, state)`: rollout k's retained batch, when there is one for exactly that state (`Rollouts` trains it
    instead of generating).
Not here: when rollouts are generated (`Rollouts`), the checkpoint (`Checkpoints`), the engines' weights on resume
(`WeightUpdates.start` pushes the checkpoint's before the first rollout).

Format (retained_journal.py): FORMAT 3 (2 read), a record file per rollout, its JSON line then the per-token data as raw
bytes, never turned into lists (the samples' compact columns stay compact); a crash mid-write leaves the records
before it whole. FORMAT-1 journals (`retained/rollouts.jsonl`) are still read, and rewritten by a resume. No pickle.

The scheduler state at each boundary is `RolloutScheduler.snapshot()` (`Rollouts._generate`: the state a rollout
starts from and the one it leaves): its partial buffer as memory copies of its samples (rollout/buffer_snapshot.py),
digested from their bytes (controller/state_digest.py) and journaled raw; only a checkpoint makes it JSON.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

from hpc_rl.controller.fault_hooks import (HOLD_CONTROLLER_AFTER_RETAIN, KILL_CONTROLLER_AFTER_RETAIN,
                                          hold_here_if_asked, kill_here_if_asked)
from hpc_rl.controller.retained_journal import FORMAT, JOURNAL, MAX_RECORDS, RetainedBatch, RolloutJournal
from hpc_rl.controller.state_digest import DIGEST, state_digest
from hpc_rl.data.samples import Group

__all__ = ["FORMAT", "JOURNAL", "MAX_RECORDS", "RetainedBatch", "Retention", "RolloutJournal", "allowed_lag",
           "state_digest"]

log = logging.getLogger(__name__)


class Retention:
    """The run's retained rollouts (see the module docstring). `enabled` False: every call does nothing."""

    def __init__(self, run_dir: str | Path, *, session_id: str | None, allowed_lag: int, enabled: bool = True,
                 print_fn: Any = print) -> None:
        self.journal = RolloutJournal(Path(run_dir) / JOURNAL)
        self.session_id, self.allowed_lag, self.enabled = session_id, allowed_lag, enabled
        self.print = print_fn
        self._records: list[RetainedBatch] = []
        """What the journal holds (this attempt's view), oldest first: `RetainedBatch.stub()`s once written and
        not to be trained from memory (the samples are the trainer's, not kept here)."""
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
        encoded = batch.encode()
        with self._lock:
            self.journal.write(batch, encoded)
            self._records = [r for r in self._records if r.rollout_id != rollout_id] + [batch.stub()]
            if len(self._records) > MAX_RECORDS:
                self._records = self._records[-MAX_RECORDS:]
                self.journal.keep_only(self._records)
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
        state, expected = scheduler_state, next_rollout_id
        for record in records:
            if record.rollout_id < expected:
                continue  # trained and checkpointed already
            digest = state_digest(state)
            why = self._refusal(record, expected, digest if record.digest_kind == DIGEST else
                                state_digest(state, kind=record.digest_kind), weight_version)
            if why is not None:
                self._say(f"hpc_rl: retained rollouts from rollout {record.rollout_id} on are generated again: {why}")
                break
            record.state_before, record.digest_kind = digest, DIGEST  # (an older record's: now today's digest)
            self._ready[record.rollout_id] = record
            state, expected = record.state_after, expected + 1
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
            self._let_go()
            return None
        self._let_go()  # (its samples are the caller's now)
        self.trained_samples += batch.num_samples
        log.info("rollout %d: %d retained samples (weights v%d) trained instead of generated", rollout_id,
                 batch.num_samples, batch.weight_version)
        return batch


    def _let_go(self) -> None:
        """Keep only stubs of the written records that are not to be trained from memory any more."""
        with self._lock:
            self._records = [r.stub() if r.rollout_id not in self._ready and r.stored is not None and not r.file_only
                             else r for r in self._records]

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
