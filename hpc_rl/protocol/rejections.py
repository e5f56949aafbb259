"""Warnings about peers refused before they authenticated, rate-limited.

Owns `RejectionLog`: anyone who reaches the controller's port can make it refuse a connection (garbage,
a wrong secret, a silent socket), so one warning per refusal would let a stranger fill the user's console
and the log disk. The first `burst` refusals of each `window_s` are logged one by one; the rest are counted
and summed up in one line (how many, from how many peers, the last reason) when the window ends or the
server closes. Refusals of authenticated peers (a bug in one of the job's own processes) are not this
module's: the server logs each of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

_MAX_PEERS_NAMED = 5


class RejectionLog:
    """`refused(peer, reason)` for each unauthenticated peer turned away; `flush()` on close."""

    def __init__(self, logger: logging.Logger, *, burst: int = 5, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.burst, self.window_s, self.clock = logger, burst, window_s, clock
        self.total = 0
        """Every refusal since the server started (logged or not)."""
        self._window_start = clock()
        self._in_window = 0
        self._suppressed = 0
        self._suppressed_peers: set[str] = set()
        self._last_reason = ""

    def refused(self, peer: str, reason: str) -> None:
        self.total += 1
        if self.clock() - self._window_start >= self.window_s:
            self.flush()
        self._in_window += 1
        if self._in_window <= self.burst:
            suffix = " (further refusals in the next %.0f s are summed up)" % self.window_s \
                if self._in_window == self.burst else ""
            self.logger.warning("refused unauthenticated connection from %s: %s%s", peer, reason, suffix)
            return
        self._suppressed += 1
        self._last_reason = reason
        host = peer.rsplit(":", 1)[0]
        if len(self._suppressed_peers) <= _MAX_PEERS_NAMED:
            self._suppressed_peers.add(host)

    def flush(self) -> None:
        """Log the summary of the refusals not logged one by one; start a new window."""
        if self._suppressed:
            peers = sorted(self._suppressed_peers)
            named = ", ".join(peers[:_MAX_PEERS_NAMED]) + (", ..." if len(peers) > _MAX_PEERS_NAMED else "")
            self.logger.warning("refused %d more unauthenticated connection(s) from %s; last reason: %s",
                                self._suppressed, named, self._last_reason)
        self._window_start = self.clock()
        self._in_window = 0
        self._suppressed = 0
        self._suppressed_peers.clear()
        self._last_reason = ""
