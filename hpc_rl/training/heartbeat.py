"""A trainer rank's heartbeat: a thread that tells the controller, every few seconds, that the process runs.

Owns the thread and its connection (its own, authenticated like the rank's command link: the command link is
busy for as long as a command or the wait for the next one lasts, and the server answers one connection's
messages in order). Why a thread and not the command loop: a long train step or save legitimately computes for
minutes without reaching the loop, and this thread beats through it (torch's kernels release the GIL); a rank
SIGSTOPped (or a whole process frozen) stops every thread, so its beats stop, and the controller
(`controller.trainer_channel`) names it. The beat gives up quietly when the controller is gone: the command
link says so, with the real error.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from hpc_rl.protocol import BlockingClient, Hello
from hpc_rl.protocol.messages import TrainerHeartbeat
from hpc_rl.protocol.secret import Secret

log = logging.getLogger(__name__)


class HeartbeatThread:
    """`HeartbeatThread(host, port, secret, rank=0, interval_s=5.0).start()`; `close()` stops it."""

    def __init__(self, host: str, port: int, secret: Secret, *, rank: int, interval_s: float) -> None:
        self.host, self.port, self.secret = host, port, secret
        self.rank, self.interval_s = rank, interval_s
        self.beats = 0
        """Heartbeats the controller acknowledged."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"trainer-rank-{rank}-heartbeat", daemon=True)

    def start(self) -> HeartbeatThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        hello = Hello(role="trainer_heartbeat", rank=self.rank, host=socket.gethostname(), pid=os.getpid())
        try:
            with BlockingClient(self.host, self.port, self.secret, hello=hello,
                                timeout=max(30.0, 3 * self.interval_s)) as client:
                while True:
                    client.request(TrainerHeartbeat(rank=self.rank))
                    self.beats += 1
                    if self._stop.wait(self.interval_s):
                        return
        except Exception as error:  # noqa: BLE001 - the controller is gone or refused: the command link says why
            if not self._stop.is_set():
                log.info("trainer rank %d: heartbeat stopped (%s: %s)", self.rank, type(error).__name__, error)

    def close(self) -> None:
        self._stop.set()
