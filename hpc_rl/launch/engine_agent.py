"""One engine's agent in an engine job: it finds the run's controller, registers the engine, follows the
controller across trainer restarts, and tells it when the engine leaves (docs/engine-jobs.md).

Owns, for one engine that already answers /health: reading `<run_dir>/controller.address` (the controller lives
with the trainer's job and writes it at each start), an authenticated connection to it with the run's secret
(`<run_dir>/secret`, the protocol every process of the run speaks: no new open port, nothing pickled), the
`EngineJoin` (again to every new controller: the address changed or the connection dropped), a `Ping` every
`poll_s` while connected, `EngineLeave` when asked to stop (SIGTERM/USR1 from Slurm at the time limit or on
preemption; the caller sets `stop`), and giving up after `cleanup_timeout_s` without a controller (slime's
--rollout-cleanup-timeout). Not here: starting and stopping the engine process (`engine_job`).

    no controller ──address file, connect, Hello(engine), EngineJoin──> joined(index)
         ^  (address changed, connection lost)                             │ Ping every poll_s
         └─────────────────────────────────────────────────────────────────┤
    stop set ──> EngineLeave(index) ──> EngineLeft(requeued, drain_s) ──> return
    no controller for cleanup_timeout_s ──> return
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpc_rl.controller.address import CONTROLLER_ADDRESS_FILE
from hpc_rl.protocol import BlockingClient, Hello, load_secret, secret_path
from hpc_rl.protocol.messages import EngineJoin, EngineJoined, EngineLeave, EngineLeft, ErrorReply, Ping

log = logging.getLogger("hpc_rl.engine_agent")

LEAVE_TIMEOUT_S = 400.0
"""How long a leave may take (the controller first waits for a weight sync the engine is in, then drains it)."""


@dataclass
class AgentOutcome:
    """How the agent ended, and what it saw (for the job's log and tests)."""

    reason: str
    joins: list[tuple[str, int]] = field(default_factory=list)
    """(controller address, engine index) of each registration, in order."""
    left: EngineLeft | None = None


class EngineAgent:
    """Registers one engine with the run's controller and keeps it registered (see the module docstring)."""

    def __init__(self, run_dir: str | Path, *, url: str, tp_size: int, job_id: str, name: str,
                 cleanup_timeout_s: float, poll_s: float = 1.0) -> None:
        self.run_dir = Path(run_dir)
        self.url, self.tp_size, self.job_id, self.name = url, tp_size, job_id, name
        self.cleanup_timeout_s, self.poll_s = cleanup_timeout_s, poll_s
        self.stop = threading.Event()
        """Set it to make the engine leave (the job's signal handler does)."""
        self.stop_reason = "the engine job ends"
        self.index: int | None = None
        """The engine's index with the current controller (None: not registered)."""
        self._client: BlockingClient | None = None
        self._address = ""

    def _read_address(self) -> str:
        try:
            return (self.run_dir / CONTROLLER_ADDRESS_FILE).read_text().strip()
        except OSError:
            return ""

    def _connect(self, address: str) -> int:
        host, _, port = address.rpartition(":")
        client = BlockingClient(host, int(port), load_secret(secret_path(self.run_dir)), timeout=LEAVE_TIMEOUT_S,
                                hello=Hello(role="engine", host=socket.gethostname(), pid=os.getpid(),
                                            info={"job_id": self.job_id, "url": self.url}))
        try:
            reply = client.request(EngineJoin(url=self.url, tp_size=self.tp_size, job_id=self.job_id, name=self.name))
        except BaseException:
            client.close()
            raise
        if not isinstance(reply, EngineJoined):
            client.close()
            raise RuntimeError(f"the controller at {address} refused the engine: "
                               f"{reply.message if isinstance(reply, ErrorReply) else reply.TYPE}")
        self._client, self._address, self.index = client, address, reply.engine_index
        return reply.engine_index

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client, self._address, self.index = None, "", None

    def run(self) -> AgentOutcome:
        """Until `stop` is set (leave, return) or no controller was there for `cleanup_timeout_s`."""
        outcome = AgentOutcome(reason="")
        last_controller = time.monotonic()
        while not self.stop.is_set():
            address = self._read_address()
            if self._client is not None and address != self._address:
                log.info("%s: the controller moved (%s -> %s): registering again", self.name, self._address,
                         address or "none")
                self._disconnect()
            if self._client is None and address:
                try:
                    index = self._connect(address)
                    outcome.joins.append((address, index))
                    log.info("%s: joined the run at %s as engine %d", self.name, address, index)
                except Exception as error:  # noqa: BLE001 - a controller starting, ending or gone: try again
                    log.info("%s: no controller at %s yet: %s", self.name, address, error)
            if self._client is not None:
                try:
                    self._client.request(Ping())
                    last_controller = time.monotonic()
                except Exception as error:  # noqa: BLE001 - the controller went away
                    log.info("%s: lost the controller at %s: %s", self.name, self._address, error)
                    self._disconnect()
            if self._client is None and time.monotonic() - last_controller > self.cleanup_timeout_s:
                outcome.reason = f"no controller for {self.cleanup_timeout_s:g} s (rollout_cleanup_timeout)"
                return outcome
            self.stop.wait(self.poll_s)
        outcome.reason = self.stop_reason
        outcome.left = self.leave()
        return outcome

    def leave(self) -> EngineLeft | None:
        """Tell the controller the engine leaves and wait until it is drained (None: no controller to tell)."""
        if self._client is None or self.index is None:
            return None
        try:
            reply = self._client.request(EngineLeave(engine_index=self.index, reason=self.stop_reason))
        except Exception as error:  # noqa: BLE001 - the controller went away: the health check fails the engine
            log.warning("%s: leave not confirmed: %s", self.name, error)
            return None
        finally:
            self._disconnect()
        if isinstance(reply, EngineLeft):
            log.info("%s: left: %d request(s) requeued in %.3f s", self.name, reply.requeued, reply.drain_s)
            return reply
        log.warning("%s: leave refused: %s", self.name, getattr(reply, "message", reply.TYPE))
        return None
