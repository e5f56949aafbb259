"""No process of a run outlives it: adopt the orphans of a dead process, and end them.

A trainer rank that dies (SIGKILL, the OOM killer) leaves its own children behind: Megatron's checkpoint
writer starts a multiprocessing Manager (a spawned process) and with it the resource tracker. They run in
the rank's session, which torchrun only signals for ranks that are still alive, so Linux hands them to
PID 1 and they stay (274 MB each, seen after every trainer death; issue 24). A process that marks itself
a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`) gets its descendants' orphans instead of PID 1:
`bound_torchrun` (torchrun's agent) and the local driver do, and end what they adopted when they stop.

Owns: becoming a subreaper, listing this process's children (from /proc), and ending them (SIGTERM, then
SIGKILL after a grace) with their exit reaped. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants of this process become its children (not PID 1's); whether that worked."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int | None = None) -> list[int]:
    """The processes whose parent is `pid` (this process by default)."""
    parent = os.getpid() if pid is None else pid
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def environ_has(pid: int, key: str, value: str) -> bool:
    """Whether process `pid` was started with `key=value` in its environment."""
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{key}={value}".encode() in entries


def end_children(*, keep: Callable[[int], bool] = lambda pid: False, grace_s: float = 3.0) -> list[int]:
    """SIGTERM every child (except those `keep` names), SIGKILL what is left after `grace_s`, reap them;
    the grandchildren this orphans are adopted next and ended the same way. Returns the pids ended."""
    ended: list[int] = []
    deadline = time.monotonic() + grace_s
    while True:
        for pid in ended:
            _reap(pid)
        targets = [pid for pid in children() if not keep(pid)]
        if not targets or time.monotonic() > deadline + 10:  # (a process stuck in the kernel: give up)
            return ended
        killing = time.monotonic() > deadline
        for pid in targets:
            if pid not in ended or killing:
                try:
                    os.kill(pid, signal.SIGKILL if killing else signal.SIGTERM)
                except ProcessLookupError:
                    pass
            if pid not in ended:
                ended.append(pid)
        time.sleep(0.05)


def _reap(pid: int) -> None:
    """Collect `pid`'s exit status if it has ended (no zombie); a running or foreign pid is left alone."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
