"""Child processes for engines and routers: start with a log file, stop without orphans.

Owns: starting a command in its own process group (`start_new_session`) with stdout+stderr in a
log file, stopping the whole group (SIGTERM, then SIGKILL after a grace period), reading a log's
tail for error messages, polling an HTTP endpoint until it answers, and finding a free port.
A `ChildProcess` also stops its group when the parent exits normally (atexit). Also owns
`exit_without_teardown`, how hpc_rl's own child processes end after a clean run.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from hpc_rl.protocol.http_client import request_blocking


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` (bind to 0); racy by nature, so use it at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


PLANNED_PORTS_START = 30000
_PLANNED_HERE: collections.deque[int] = collections.deque(maxlen=64)
"""The last ports `planned_port` returned in this process: two plans made before either binds (an engine and a
router, two engines of a test) never get the same port."""


def ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def planned_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A free port on `host` for a server that binds it seconds later (a local run's plan): drawn between
    30000 (Slurm jobs' planned ports stay below, see launch.ports.JOB_PORT_SLOTS) and the kernel's ephemeral
    range, where no outgoing connection can take it meanwhile (a `free_port` port can: a local run once
    lost its torchrun rendezvous port that way). `free_port` when that window is too small or full."""
    rng = rng or random.Random()
    low, _ = ephemeral_port_range()
    if low - PLANNED_PORTS_START < 100:
        return free_port(host)
    for _ in range(200):
        port = rng.randrange(PLANNED_PORTS_START, low)
        if port in _PLANNED_HERE:  # handed out by this process, maybe not bound yet: free now, taken soon
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _PLANNED_HERE.append(port)
        return port
    return free_port(host)


def log_tail(path: str | Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ('' if it does not exist)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ChildProcessFailed(RuntimeError):
    """A child process failed to start, died, or never became ready; the message has its log tail."""


class ChildProcess:
    """One command in its own process group, logging to `log_path`."""

    def __init__(self, command: Sequence[str], *, log_path: str | Path, env: Mapping[str, str] | None = None,
                 name: str = "child") -> None:
        self.command = list(command)
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.name = name
        self.popen: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def start(self) -> None:
        self.popen = start_process_group(self.command, env=self.env, log_path=self.log_path)
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_seconds: float = 5.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_seconds`; return the exit code."""
        if self.popen is None:
            return None
        atexit.unregister(self.stop)
        return stop_process_group(self.popen, grace_seconds)

    def failure(self, what: str) -> ChildProcessFailed:
        exited = self.popen is not None and self.popen.poll() is not None
        state = f"exited with code {self.popen.returncode}" if exited else "is still running"
        return ChildProcessFailed(
            f"{self.name} {what}; it {state}. Command: {' '.join(self.command)}\n"
            f"Last lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )


def exit_without_teardown(code: int = 0) -> NoReturn:
    """End this process now, as a normal exit would but without the interpreter's teardown.

    Runs the atexit handlers (logging flushed; multiprocessing stops its children, e.g. the Manager
    Megatron's checkpoint writer starts; torch's handlers), flushes stdio, then `os._exit`. What is
    skipped is freeing every object and module: on a loaded 2-core machine that took 3-4 s in the CPU
    engine and ~5 s in a trainer rank after the last step (mostly garbage collection of torch,
    transformers and Megatron objects), time the whole run waited for (issue 11: fast shutdown)."""
    try:
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def die_with_parent() -> None:
    """In a child before exec: SIGTERM it when its parent dies, even by SIGKILL (Linux prctl).

    Children run in their own session (so a stop can signal the whole group); this keeps a killed
    driver from leaving them behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def signal_group(group: int, sig: signal.Signals) -> None:
    """Signal a process group; a group that is already gone is not an error."""
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_process_group(command: Sequence[str], *, env: Mapping[str, str] | None, log_path: str | Path | None,
                        tie_to_parent: bool = True) -> subprocess.Popen:
    """Start `command` as the leader of a new session (so stopping it reaches its children), stdout and
    stderr appended to `log_path` (None: discarded); with `tie_to_parent`, it dies with this process."""
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None, start_new_session=True,
            preexec_fn=die_with_parent if tie_to_parent else None,
        )
    finally:
        if log_path is not None:
            log.close()  # the child holds its own descriptor


def stop_process_group(popen: subprocess.Popen, grace_seconds: float,
                       on_timeout: Callable[[], None] | None = None) -> int | None:
    """SIGTERM the group of `popen`, wait `grace_seconds` (then `on_timeout()`), SIGKILL whatever is
    left of the group (children may outlive their leader), and return the leader's exit code. SIGCONT follows
    the SIGTERM, as Slurm's does: a stopped process (SIGSTOP, a stuck engine being restarted) handles it now
    instead of being SIGKILLed after the whole grace."""
    if popen.poll() is None:
        signal_group(popen.pid, signal.SIGTERM)
        signal_group(popen.pid, signal.SIGCONT)
        try:
            popen.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            if on_timeout is not None:
                on_timeout()
    signal_group(popen.pid, signal.SIGKILL)
    try:
        return popen.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


def http_ok(url: str, *, timeout: float = 2.0, api_key: str | None = None) -> bool:
    """True when GET `url` answers 200."""
    try:
        return request_blocking("GET", url, api_key=api_key, timeout_s=timeout)[0] == 200
    except ConnectionError:
        return False


def wait_until(ready: Callable[[], bool], *, process: ChildProcess, timeout: float, what: str,
               interval: float = 0.2) -> None:
    """Poll `ready` until true; raise with the log tail on timeout or if the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if not process.alive():
            raise process.failure(f"died before {what}")
        time.sleep(interval)
    raise process.failure(f"was not {what} after {timeout:.0f} s")
