"""Writing a run's own files when the disk may be full: what the error is called, and a log handler that
says so once instead of once per line.

Owns `describe_write_error` ("no space left on <dir>" for ENOSPC/EDQUOT, else the OS's words),
`write_text_atomically` (a temporary file renamed into place; the temporary file never stays behind),
`rollouts.jsonl`'s records (`append_rollout_record`: a line is appended whole or not at all;
`drop_rollout_records_from`: a resumed run moves the lines of the rollouts it redoes to
`rollouts.redone.jsonl`, never deleting one) and
`RunLogFileHandler` (a FileHandler that, when its file cannot be written, prints ONE line on stderr and
drops file output until a write succeeds again; Python's own prints "--- Logging error ---" and a
traceback for every record).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from hpc_rl.data.samples import Group

ROLLOUT_RECORDS = "rollouts.jsonl"
"""One JSON line per finished rollout, in the run dir (written by the run loop)."""
_DISK_FULL = {errno.ENOSPC: "no space left on", errno.EDQUOT: "disk quota exceeded on"}


def describe_write_error(error: OSError, path: str | Path) -> str:
    """e.g. "no space left on /scratch/run (writing status.json)"; other errors as the OS says them."""
    path = Path(path)
    if error.errno in _DISK_FULL:
        return f"{_DISK_FULL[error.errno]} {path.parent} (writing {path.name})"
    return f"cannot write {path}: {error.strerror or error}"


def write_text_atomically(path: str | Path, text: str) -> None:
    """`path` holds `text` completely or keeps its old content; raises OSError (nothing left behind)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def rollout_record(rollout_id: int, metrics: dict[str, Any], groups: list[Group]) -> dict[str, Any]:
    """A rollout's record: its metrics and which samples were trained (index, data row and start rollout of
    each group, the version of each sample's first token); plain JSON types (a checkpoint carries it too)."""
    samples = [s for g in groups for s in g]
    record = {"rollout_id": rollout_id, "metrics": metrics,
              "sample_indices": [s.index for s in samples],
              "data_rows": [s.metadata.get("data_row") for g in groups for s in g[:1]],
              "start_rollout_ids": [s.metadata.get("start_rollout_id") for g in groups for s in g[:1]],
              "weight_versions_first_token": [versions[0] if len(versions) else None
                                              for versions in (s.column("weight_versions") for s in samples)]}
    return json.loads(json.dumps(record, default=float))


def append_rollout_record(path: str | Path, rollout_id: int, metrics: dict[str, Any], groups: list[Group]) -> None:
    """One JSON line: `rollout_record`."""
    append_line(path, json.dumps(rollout_record(rollout_id, metrics, groups)))


def recorded_rollouts(path: str | Path) -> set[int]:
    """The rollout ids rollouts.jsonl holds records of."""
    found: set[int] = set()
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return found
    for line in lines:
        try:
            rollout_id = json.loads(line)["rollout_id"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(rollout_id, int):
            found.add(rollout_id)
    return found


def append_line(path: str | Path, line: str) -> None:
    """Append `line` whole or not at all: one write(2) to the end; when it fails or comes up short (a full
    disk), the file is cut back to its previous size, so no reader ever meets half a record, and the
    OSError names the file."""
    data = (line + "\n").encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(descriptor).st_size
        try:
            written = os.write(descriptor, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written")
        except OSError as error:
            os.ftruncate(descriptor, size)
            raise OSError(error.errno, describe_write_error(error, path)) from error
    finally:
        os.close(descriptor)


def write_debug_rollout_data(template: str, rollout_id: int, groups: list[Group]) -> Path:
    """slime's --save-debug-rollout-data: every sample of the rollout, all fields, one JSON object per line."""
    path = Path(template.format(rollout_id=rollout_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for sample in (s for g in groups for s in g):
            handle.write(json.dumps(sample.to_dict(), default=str) + "\n")
    return path


REDONE_RECORDS = "rollouts.redone.jsonl"
"""Beside rollouts.jsonl: the records a resume took out of it (rollouts redone after an older checkpoint), kept."""


def drop_rollout_records_from(path: str | Path, first_redone: int) -> int:
    """Move the records of rollouts >= `first_redone` (written after the checkpoint a run resumes from,
    by the attempt that was stopped: they are redone) from `path` to `rollouts.redone.jsonl` beside it (appended:
    a resume never destroys a record). Returns how many were moved. Lines that are not records (a line cut
    short by the stop) go too (dropped)."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept: list[str] = []
    moved: list[str] = []
    dropped = 0
    for line in path.read_text().splitlines():
        try:
            rollout_id = json.loads(line)["rollout_id"]
        except (ValueError, KeyError, TypeError):
            dropped += bool(line.strip())
            continue
        if isinstance(rollout_id, int) and rollout_id < first_redone:
            kept.append(line)
        else:
            moved.append(line)
    if moved:
        for line in moved:  # first: a crash between the two leaves a record twice, never none
            append_line(path.with_name(REDONE_RECORDS), line)
    if moved or dropped:
        write_text_atomically(path, "".join(line + "\n" for line in kept))
    return len(moved) + dropped


class RunLogFileHandler(logging.FileHandler):
    """A run's log file that survives a full disk: one line on `console` when writing fails, one when it
    works again, nothing per record in between."""

    def __init__(self, filename: str | Path, console: TextIO | None = None) -> None:
        super().__init__(filename)
        self.console = console
        self.failing = False
        """True from a failed write until one succeeds."""
        self.dropped = 0
        self._failed_now = False

    def _say(self, text: str) -> None:
        print(f"hpc_rl: log file {self.baseFilename}: {text}", file=self.console or sys.stderr, flush=True)

    def emit(self, record: logging.LogRecord) -> None:
        self._failed_now = False
        super().emit(record)  # calls handleError on a failed write
        if self.failing and not self._failed_now:
            self.failing = False
            self._say(f"written again ({self.dropped} line(s) were lost)")
            self.dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self._failed_now = True
        self.dropped += 1
        if not self.failing:
            self.failing = True
            self._say(f"{describe_write_error(error, self.baseFilename)}; its lines are lost until it can be "
                      "written again")
