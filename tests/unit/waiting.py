"""Waiting in tests for the event itself, not for a fixed time: `wait_until` polls a condition until it holds.

A fixed `sleep` standing in for an event ("the request has reached the engine by now") holds on a quiet machine
and fails on a loaded one. The deadline here only bounds a test whose event never comes, so it is generous; a
test that needs a bound on how long something takes asserts that bound itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEADLINE_S = 30.0
"""How long a condition may take to hold before the test fails (a loaded 2-core CI machine included)."""


async def wait_until(condition: Callable[[], bool], timeout: float = DEADLINE_S, what: str = "condition") -> None:
    """Poll `condition` on the running loop every 5 ms until it holds; AssertionError after `timeout` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not reached within {timeout} s"
        await asyncio.sleep(0.005)


def wait_until_blocking(condition: Callable[[], bool], timeout: float = DEADLINE_S, what: str = "condition") -> None:
    """`wait_until` for a test without an event loop (a thread or a child process makes the condition true)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.005)
