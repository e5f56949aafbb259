"""How the weight-update group's collectives complete on trainer rank 0: NCCL's way, and its gloo twin.

Owns `CollectiveStream`. On NCCL, `work.wait()` does not block the CPU: it makes the GPU's current stream
wait for the collective. Rank 0 therefore reports a broadcast done at once, and a broadcast that never
completes (an engine died mid-sync: NCCL notices no dead peer) shows up later, when the next GPU work that
depends on it makes the CPU wait, and ends when NCCL's watchdog times the collective out (the group's
timeout, 600 s by default) and takes the process down. gloo blocks in `wait()` and raises at once when a
peer's socket closes, so the CPU path never saw that hang. The twin makes gloo behave as NCCL here:

    wait(work)      NCCL: orders the stream, returns;         twin: returns (the work stays pending)
    reusable(work)  NCCL: yes (the next kernel waits for it); twin: only once it completed (no overwrite)
    synchronize()   NCCL: nothing (the GPU blocks by itself);  twin: waits for every pending work; one that
                    failed (a peer died) hangs until the group's timeout, then raises CollectiveTimeout
    abort(group)    both: abort the communicator (ncclCommAbort; gloo's abort): pending work is dropped,
                    nothing waits for it, the group is gone (the twin's gloo abort, which waits for a
                    collective in flight, runs on a thread of its own: NCCL's returns at once)

The trainer calls `synchronize()` where the GPU would next make the CPU wait (the start of its next
command), so a test sees the hang on the CPU path; the controller bounds it with `abort` (an
`AbortWeightGroupCommand`) as soon as it knows an engine broke the sync.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_ABORTED_TWIN_GROUPS: list[dist.ProcessGroup] = []
"""Groups the gloo twin aborted: never destroyed (see `CollectiveStream.abort`)."""


class CollectiveTimeout(RuntimeError):
    """The twin of NCCL's watchdog: a weight-group collective did not complete within the group's timeout."""


@dataclass
class _Pending:
    work: dist.Work
    issued_at: float
    what: str


class CollectiveStream:
    """The pending collectives of one weight-update group (see the module docstring)."""

    def __init__(self, backend: str, *, timeout_s: float) -> None:
        self.twin = backend == "gloo"
        self.timeout_s = timeout_s
        self.pending: list[_Pending] = []

    def issued(self, work: dist.Work, what: str) -> None:
        if self.twin:
            self.pending.append(_Pending(work, time.monotonic(), what))

    def wait(self, work: dist.Work) -> None:
        if not self.twin:
            work.wait()  # NCCL: the current stream waits; the CPU does not

    def reusable(self, work: dist.Work) -> bool:
        """May the buffer this work reads be refilled now (on the twin: only when it completed)?"""
        return not self.twin or work.is_completed()

    def synchronize(self) -> None:
        """Where the GPU would next make the CPU wait for the group's work (twin only; see the docstring)."""
        while self.pending:
            pending = self.pending[0]
            try:
                pending.work.wait()
            except Exception as error:  # noqa: BLE001 - gloo's peer error; NCCL would not see it, it hangs
                remaining = pending.issued_at + self.timeout_s - time.monotonic()
                if remaining > 0:
                    time.sleep(remaining)
                raise CollectiveTimeout(
                    f"weight-update {pending.what} did not complete within {self.timeout_s:.0f} s (NCCL's watchdog "
                    f"ends the process here; the CPU twin saw: {error})") from error
            self.pending.pop(0)

    def abort(self, group: dist.ProcessGroup | None) -> None:
        """Abort the group's communicator: its pending collectives are dropped, nothing waits for them. NCCL's
        abort returns at once; gloo's waits for a collective in flight to end, which a peer that is alive but
        stopped (SIGSTOP, a hung GPU) never lets happen (measured: the abort did not return within 10 s): the
        twin aborts on a thread of its own and returns, as NCCL does (the group is gone for the caller)."""
        self.pending.clear()
        if group is None:
            return
        if not self.twin:
            c10d._abort_process_group(group)
            return
        # gloo's ProcessGroup destructor also waits for the collective in flight: when the caller drops its last
        # reference, the thread dropping it would hang as the abort would (seen: the trainer's command thread,
        # once the abort thread was done). Aborted twin groups are kept for the life of the process.
        _ABORTED_TWIN_GROUPS.append(group)
        threading.Thread(target=c10d._abort_process_group, args=(group,), name="abort weight-update group",
                         daemon=True).start()
