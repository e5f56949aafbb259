"""A bound on sympy for the math graders: caps on what it is given, and a time limit where one can be set.

Owns `within_bounds` (the caps), `run_bounded` (the time limit) and the notes of comparisons given up
(`take_give_ups`), so the caller names the sample. Not here: what is compared and how (`math_equivalence`).

A rule reward scored on the controller's loop (`rollout.reward_workers` 0) is a plain function call that
`rollout.reward_timeout` cannot cut, and sympy has no bound of its own. slime's guards (at most two
letters, no `^{`, `^(`, `^12`, `^2^`) leave room for answers a policy can write; measured here (2-core
machine, load ~12): `(9!)!` 9.6 s, `x**x**x**x` 2.4 s, `((x+1)^9+1)^9` and `9**9**9` more than 20 s, the
last inside one C call (Python's integer power) that no signal interrupts. So:

- caps, checked before sympy sees anything: at most MAX_EXPRESSION_CHARS characters; `**` counts as `^`
  for slime's exponent guards (no power towers, no exponent of two or more digits); a factorial only of a
  number of at most three digits (`(9!)!`, `9!!` and `1000!` are refused);
- time: on a process's main thread (the controller's loop, a reward worker) parsing and simplifying run
  under a SIGALRM timer of SYMPY_TIME_LIMIT_S that raises out of sympy's Python code. Elsewhere (a custom
  reward function on its thread calling these graders) only the caps hold; its call is bounded by
  `rollout.reward_timeout` as a whole.

A comparison refused by a cap or cut by the timer is "not equal", as slime scores an answer sympy cannot
handle, and is noted: `take_give_ups()` hands the notes to whoever knows which sample it was.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MAX_EXPRESSION_CHARS = 400
"""The longest difference `(truth)-(answer)` sympy is given (real answers are tens of characters)."""
SYMPY_TIME_LIMIT_S = 3.0
"""Parsing and simplifying one difference (a few ms when sympy can decide it; the first call ~100 ms)."""

_POWER_TOWER = re.compile(r"\^[0-9]+\^|\^[0-9][0-9]+")
_FACTORIAL_OF_MORE = re.compile(r"[)\]}!]\s*!|[0-9]{4,}\s*!")

_notes = threading.local()


class SymbolicTimeLimit(BaseException):
    """Raised out of sympy by the timer. A BaseException: sympy's own `except Exception` must not eat it."""


def _note(message: str) -> None:
    if not hasattr(_notes, "items"):
        _notes.items = []
    _notes.items.append(message)


def take_give_ups() -> list[str]:
    """The comparisons this thread gave up since the last call (and forget them)."""
    items = getattr(_notes, "items", [])
    _notes.items = []
    return items


def _shown(expression: str, limit: int = 80) -> str:
    return repr(expression if len(expression) <= limit else expression[:limit] + "...")


def within_bounds(expression: str) -> bool:
    """Whether sympy may be given `expression`; a refusal is noted."""
    why = ""
    if len(expression) > MAX_EXPRESSION_CHARS:
        why = f"{len(expression)} characters (at most {MAX_EXPRESSION_CHARS})"
    elif _POWER_TOWER.search(expression.replace("**", "^")):
        why = "a power tower or an exponent of two or more digits"
    elif _FACTORIAL_OF_MORE.search(expression):
        why = "a factorial of a factorial, of a bracket or of a number over three digits"
    if why:
        _note(f"sympy not asked about {_shown(expression)}: {why}")
    return not why


def run_bounded(work: Callable[[], T], expression: str, *, limit_s: float | None = None) -> T | None:
    """`work()` under the time limit (SYMPY_TIME_LIMIT_S unless given; on the main thread only, elsewhere
    unbounded); None, noted, when cut.
    Another ITIMER_REAL timer of the process (pytest-timeout's) is put back with what was left of it."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    limit_s = SYMPY_TIME_LIMIT_S if limit_s is None else limit_s
    done = [False]

    def on_alarm(signum: int, frame: object) -> None:
        if not done[0]:
            raise SymbolicTimeLimit

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    previous_delay, previous_interval = signal.getitimer(signal.ITIMER_REAL)
    # Repeating every 0.1 s after the limit: should sympy swallow one raise, the next one ends it. Every path
    # below sets `done` within microseconds of a raise, long before the next one could come.
    signal.setitimer(signal.ITIMER_REAL, min(limit_s, previous_delay or limit_s), 0.1)
    result: list[T] = []
    failure: list[Exception] = []
    try:
        try:
            result.append(work())
        except SymbolicTimeLimit:
            pass
        except Exception as error:  # noqa: BLE001 - re-raised below, once the timer is off
            failure.append(error)
        done[0] = True
    except SymbolicTimeLimit:  # the limit came just as work() ended
        done[0] = True
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous_handler)
    if previous_delay:
        left = previous_delay - (time.monotonic() - started)
        signal.setitimer(signal.ITIMER_REAL, max(left, 0.001), previous_interval)
    if failure:
        raise failure[0]
    if not result:
        _note(f"sympy gave up on {_shown(expression)} after {limit_s:g} s")
        return None
    return result[0]
