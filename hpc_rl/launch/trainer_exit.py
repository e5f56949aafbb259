"""What ended the trainer step, in one sentence: which rank, on which node, which signal or exit code.

Owns: reading torchrun's failure report from the trainer step's log and the step's own exit code.
When a rank fails, torchrun (with `--max-restarts=0`) stops the other ranks and prints a
"Root Cause (first observed failure):" block with `rank`, `host` and `exitcode` (negative: killed by
that signal). Under `srun --label` each line starts with the task's label (`1: `), which is the index of
the trainer node the torchrun ran on; the driver passes the node names so the sentence can name it.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

_ROOT_CAUSE = re.compile(r"Root Cause \(\s*first observed failure\):")
"""The header, also when srun's --label split it over two labelled lines (a write that came in two pieces)."""
_RANK = re.compile(r"(?<!\w)rank\s*:\s*(-?\d+)")
_EXITCODE = re.compile(r"(?<!\w)exitcode\s*:\s*(-?\d+)")
"""A block's fields, read from its lines joined without separators: srun --label also splits a field over two
labelled lines ('1:   exitcod' and '1: e  : -9 (pid: 12091)', seen at load 12); each field's line starts indented."""
_LABEL = re.compile(r"^(\d+): ?")

@dataclass(frozen=True)
class RankFailure:
    """torchrun's root cause: the first rank that failed."""

    rank: int | None
    exitcode: int | None
    task_label: int | None
    """srun's task label of the torchrun that reported it (the trainer node index), if labelled."""


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_phrase(code: int) -> str:
    """'was killed by signal 9 (SIGKILL)' for a negative code, 'exited with code 3' otherwise."""
    if code < 0:
        return f"was killed by signal {-code} ({signal_name(-code)})"
    if code > 128 and code - 128 < 65:  # a shell or srun reports a signal death as 128 + N
        return f"exited with code {code} (128 + {code - 128}: {signal_name(code - 128)})"
    return f"exited with code {code}"


def _task_streams(log_text: str) -> dict[int | None, list[tuple[int, str]]]:
    """The log's lines per srun task label (None: unlabelled), each as (line number in the log, text without
    the label): several agents write into the one log, and their lines interleave."""
    streams: dict[int | None, list[tuple[int, str]]] = {}
    for number, line in enumerate(log_text.splitlines()):
        label = _LABEL.match(line)
        task = int(label.group(1)) if label else None
        streams.setdefault(task, []).append((number, line[label.end():] if label else line))
    return streams


def root_causes(log_text: str) -> list[RankFailure]:
    """Every root-cause block of torchrun's reports in `log_text`, in the log's order (one per agent that failed:
    a trainer over several nodes has one agent per node, all writing into the one log). Each block is read from
    its own task's lines only."""
    found: list[tuple[int, RankFailure]] = []
    for task, lines in _task_streams(log_text).items():
        text = "\n".join(line for _, line in lines)
        starts = [0]
        for _, line in lines:
            starts.append(starts[-1] + len(line) + 1)
        for header in _ROOT_CAUSE.finditer(text):
            index = next(i for i in range(len(lines)) if starts[i + 1] > header.end())  # the header's last line
            block = "".join(line for _, line in lines[index + 1:index + 16]).split("=====", 1)[0]
            rank, code = _RANK.search(block), _EXITCODE.search(block)
            found.append((lines[index][0], RankFailure(rank=int(rank.group(1)) if rank else None,
                                                       exitcode=int(code.group(1)) if code else None,
                                                       task_label=task)))
    return [failure for _, failure in sorted(found, key=lambda item: item[0])]


def root_cause(log_text: str, agents: int = 1) -> RankFailure | None:
    """The failure to name among the last `agents` root-cause blocks (this attempt's): a rank killed by a
    signal before one that exited with a code (a rank whose peer was killed exits with 1 once the controller
    refuses it, and its agent may write its block last), else the last block; None without a block."""
    failures = root_causes(log_text)[-max(agents, 1):]
    if not failures:
        return None
    killed = [f for f in failures if f.exitcode is not None and f.exitcode < 0]
    return killed[-1] if killed else failures[-1]


def describe_trainer_exit(step_code: int | None, log_path: Path, node_names: list[str] | None = None) -> str:
    """One sentence on how the trainer step ended, e.g.
    'trainer rank 1 (on node2) was killed by signal 9 (SIGKILL); the trainer step exited with code 1'."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        text = ""
    step = "the trainer step is still running" if step_code is None else f"the trainer step {exit_phrase(step_code)}"
    failure = root_cause(text, agents=len(node_names) if node_names else 1)
    if failure is None or failure.rank is None or failure.exitcode is None:
        return f"{step} (torchrun named no failed rank; see {log_path})"
    where = ""
    if failure.task_label is not None and node_names and 0 <= failure.task_label < len(node_names):
        where = f" (on {node_names[failure.task_label]})"
    return f"trainer rank {failure.rank}{where} {exit_phrase(failure.exitcode)}; {step}"
